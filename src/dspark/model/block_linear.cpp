// y = x W^T with W held as a GGUF file's blocks of 32 (see block_linear.py for why it exists).
//
// Built by PyTorch Inductor's own C++ toolchain (CppPythonBindingsCodeCache: -O3, the CPU's vector ISA
// flags, -ffp-contract=off, OpenMP). The loader defines BITS (4: Q4_0 / Q4_1, 8: Q8_0) and OFFSET (-8 for
// Q4_0, else 0) before this file.
//
// Weight row n, block b holds 32 codes q (4 bits: byte j has element j in its low nibble and j + 16 in
// its high one; 8 bits: int8) and fp32 d[n, b], m[n, b]: w = (q + OFFSET) * d + m, one rounding per
// operation, as gguf-py dequantises (Q4_0: offset -8, m 0; Q4_1: offset 0; Q8_0: signed q, m 0), so the
// weights are bit for bit the float32 mode's.
//
// The numbers of a row never depend on the other rows: every (row m, output n) pair owns one 8-lane
// fp32 accumulator, fed k = 0, 8, 16, ... in order, then summed across lanes one fixed way. How rows and
// outputs are grouped into register tiles (by the row count) and outputs into threads changes the
// order of work, not of any sum: a token's logits are the same in a 1-row and in a 16-row forward.
#include <torch/csrc/inductor/cpp_prefix.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DSPARK_AVX2 1
#endif

constexpr int64_t BLOCK = 32;
constexpr int64_t BLOCK_BYTES = BITS == 4 ? 16 : 32;
constexpr int64_t NB = 4;  // outputs a tile
#if BITS == 4
using Code = uint8_t;
#else
using Code = int8_t;
#endif

// ---- dequantising one weight row into fp32 (the tile's scratch) --------------------------------------
static void dequantise_row(const Code* q, const float* d, const float* m, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b) {
        const Code* qb = q + b * BLOCK_BYTES;
        float* o = out + b * BLOCK;
#ifdef DSPARK_AVX2
        const __m256 vd = _mm256_set1_ps(d[b]), vm = _mm256_set1_ps(m[b]);
        __m256 codes[4];
#if BITS == 4
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb));
        const __m128i low = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        codes[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        codes[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        codes[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        codes[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#else
        for (int c = 0; c < 4; ++c) {
            const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * c));
            codes[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
        }
#endif
        for (int c = 0; c < 4; ++c) {
#if OFFSET != 0
            codes[c] = _mm256_add_ps(codes[c], _mm256_set1_ps(OFFSET));
#endif
            _mm256_storeu_ps(o + 8 * c, _mm256_add_ps(_mm256_mul_ps(codes[c], vd), vm));
        }
#else
        for (int64_t j = 0; j < BLOCK; ++j) {
#if BITS == 4
            const int code = j < 16 ? (qb[j] & 0x0F) : (qb[j - 16] >> 4);
#else
            const int code = qb[j];
#endif
            o[j] = (static_cast<float>(code) + OFFSET) * d[b] + m[b];
        }
#endif
    }
}

// ---- one tile: MB rows of x times the NT dequantised rows in `w` ---------------------------------------
#ifdef DSPARK_AVX2
using Acc = __m256;
static inline Acc acc_zero() { return _mm256_setzero_ps(); }
static inline float acc_sum(Acc v) {  // lanes (0+4, 1+5, 2+6, 3+7), then pairs, then the two halves
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#else
struct Acc {
    float lane[8];
};
static inline Acc acc_zero() { return Acc{}; }
static inline float acc_sum(Acc v) {
    float s[4];
    for (int i = 0; i < 4; ++i) s[i] = v.lane[i] + v.lane[i + 4];
    const float a = s[0] + s[2], b = s[1] + s[3];
    return a + b;
}
#endif

template <int MB, int NT>
static void tile(const float* x, const float* w, float* y, int64_t K, int64_t N) {
    Acc acc[MB][NT];
    for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = acc_zero();
    for (int64_t k = 0; k < K; k += 8) {
        for (int i = 0; i < MB; ++i) {
#ifdef DSPARK_AVX2
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + j * K + k), acc[i][j]);
#else
            for (int j = 0; j < NT; ++j)
                for (int l = 0; l < 8; ++l)
                    acc[i][j].lane[l] = std::fma(x[i * K + k + l], w[j * K + k + l], acc[i][j].lane[l]);
#endif
        }
    }
    for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NT; ++j) y[i * N + j] = acc_sum(acc[i][j]);
}

template <int NT>
static void rows_times_tile(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
    int64_t i = 0;
    for (; i + 3 <= M; i += 3) tile<3, NT>(x + i * K, w, y + i * N, K, N);
    if (M - i == 2) tile<2, NT>(x + i * K, w, y + i * N, K, N);
    if (M - i == 1) tile<1, NT>(x + i * K, w, y + i * N, K, N);
}

// x [M, K] fp32 (or what `prologue` makes [M, K] of, block_glue.h), q [N, K / 32, BLOCK_BYTES], d / m
// [N, K / 32] fp32 -> y [M, N] fp32 (plus `residual` [M, N] where `has_residual`). K % 32 == 0.
extern "C" void kernel(const float* x_in, const Code* q, const float* d, const float* m, float* y, int64_t M,
                       int64_t N, int64_t K, int64_t threads, int64_t prologue, const float* norm, float eps,
                       const float* residual, int64_t has_residual) {
    const int64_t blocks = K / BLOCK, tiles = (N + NB - 1) / NB;
    std::vector<float> scratch;
    const float* x = glue::input_rows(x_in, M, K, prologue, norm, eps, scratch);
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> w(NB * K);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t n0 = t * NB, nt = std::min(NB, N - n0);
            for (int64_t j = 0; j < nt; ++j) {
                const int64_t n = n0 + j;
                dequantise_row(q + n * blocks * BLOCK_BYTES, d + n * blocks, m + n * blocks, blocks, w.data() + j * K);
            }
            if (nt == NB) {
                rows_times_tile<NB>(x, w.data(), y + n0, M, K, N);
            } else {
                for (int64_t j = 0; j < nt; ++j) rows_times_tile<1>(x, w.data() + j * K, y + n0 + j, M, K, N);
            }
        }
    }
    glue::add_residual(y, has_residual ? residual : nullptr, M, N);
}
