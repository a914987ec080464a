// y = x W^T with W held as a GGUF file's blocks of 32 and x quantised to 8 bits per block of 32, as
// llama.cpp's CPU dot products do (the q4q8 mode; see block_linear.py for why it exists).
//
// Built by PyTorch Inductor's own C++ toolchain (CppPythonBindingsCodeCache: -O3, the CPU's vector ISA
// flags, -ffp-contract=off, OpenMP); AVX2 only. The loader defines BITS (4: Q4_0 / Q4_1, 8: Q8_0) before
// this file.
//
// Each row of x, block b: dx = max |x| / 127 and codes c = round(x / dx) in -127..127, with their sum
// sx = dx * sum(c). Weight row n, block b holds 32 codes q (4 bits, 0..15: byte j has element j in its
// low nibble and j + 16 in its high one; 8 bits: int8) and fp32 d[n, b]; m[n, mb] holds, padded with
// zeros to whole vectors of blocks, what a block adds per unit of x: Q4_1's m, Q4_0's -8 d (w = (q - 8) d),
// none for Q8_0. Then
//   y[i, n] = sum_b (d[n, b] * dx[i, b]) * (sum_k q[k] c[i, k])  +  sum_b m[n, b] * sx[i, b],
// the integer dot exact (u8 x s8 pairs summed in int16, which cannot overflow here, then int32).
//
// The numbers of a row never depend on the other rows: its codes are its own, and every (row i, output n)
// pair owns one 8-lane fp32 accumulator fed block by block in order, summed across lanes one fixed way,
// plus its m term summed the same way. How rows are grouped into register tiles changes the order of
// work, not of any sum: a token's logits are the same in a 1-row and in a 16-row forward.
#include <torch/csrc/inductor/cpp_prefix.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the q4q8 kernel needs AVX2 and FMA"
#endif

constexpr int64_t BLOCK = 32;
constexpr int64_t BLOCK_BYTES = BITS == 4 ? 16 : 32;
constexpr bool HAS_M = BITS == 4;
#if BITS == 4
using Code = uint8_t;
#else
using Code = int8_t;
#endif

static inline float lanes_sum(__m256 v) {  // lanes (0+4, 1+5, 2+6, 3+7), then pairs, then the two halves
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// ---- a row of x -> codes c [K] int8, scales dx [K / 32], block sums sx [K / 32] -------------------------
static void quantise_row(const float* x, int64_t K, int8_t* c, float* dx, float* sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / BLOCK; ++b) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(x + b * BLOCK + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        const float d = _mm_cvtss_f32(m) / 127.0f;
        const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int j = 0; j < 4; ++j)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
        dx[b] = d;
        sx[b] = d * static_cast<float>(_mm_cvtsi128_si32(s));
        // 32 int32 -> 32 int8 in element order (the packs interleave 128-bit lanes; the permute undoes it)
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + b * BLOCK), ordered);
    }
}

// the 32 codes of a block as 32 bytes in element order (4 bits: 0..15; 8 bits: int8)
static inline __m256i weight_codes(const Code* qb) {
#if BITS == 4
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
#else
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb));
#endif
}

// ---- MB rows times one weight row n -------------------------------------------------------------------
template <int MB>
static void rows_times_weight(const int8_t* c, const float* dx, const float* sx, const Code* q, const float* d,
                              const float* m, float* y, int64_t K, int64_t N, int64_t mb) {
    const int64_t blocks = K / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const __m256i w = weight_codes(q + b * BLOCK_BYTES);
#if BITS == 8
        const __m256i w_abs = _mm256_sign_epi8(w, w);  // maddubs wants one unsigned side: |w| x sign(w) c
#endif
        for (int i = 0; i < MB; ++i) {
            const __m256i ci = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i * K + b * BLOCK));
#if BITS == 4
            const __m256i pairs = _mm256_maddubs_epi16(w, ci);
#else
            const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(ci, w));
#endif
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * dx[i * blocks + b]), dot, acc[i]);
        }
    }
    for (int i = 0; i < MB; ++i) {
        float v = lanes_sum(acc[i]);
        if (HAS_M) {
            __m256 am = _mm256_setzero_ps();
            for (int64_t b = 0; b < mb; b += 8)
                am = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(sx + i * mb + b), am);
            v += lanes_sum(am);
        }
        y[i * N] = v;
    }
}

// x [M, K] fp32 (or what `prologue` makes [M, K] of, block_glue.h), q [N, K / 32, BLOCK_BYTES], d [N, K / 32]
// fp32, m [N, mb] fp32 (Q4 only) -> y [M, N] fp32 (plus `residual` [M, N] where `has_residual`). K % 32 == 0.
extern "C" void kernel(const float* x, const Code* q, const float* d, const float* m, float* y, int64_t M,
                       int64_t N, int64_t K, int64_t threads, int64_t prologue, const float* norm, float eps,
                       const float* residual, int64_t has_residual) {
    constexpr int MB = 4;  // rows a tile (measured on an AVX2-only EPYC: 1 output x 4 rows fastest; 2 and 3
                           // leftover rows one tile too: 3 rows cost 25.3 ms a forward, not 29.3)
    const int64_t blocks = K / BLOCK, mb = (blocks + 7) / 8 * 8;
    std::vector<float> scratch;
    const float* rows = glue::input_rows(x, M, K, prologue, norm, eps, scratch);
    std::vector<int8_t> c(M * K);
    std::vector<float> dx(M * blocks), sx(M * mb, 0.0f);
    for (int64_t i = 0; i < M; ++i) quantise_row(rows + i * K, K, c.data() + i * K, dx.data() + i * blocks, sx.data() + i * mb);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        const Code* qn = q + n * blocks * BLOCK_BYTES;
        int64_t i = 0;
        for (; i + MB <= M; i += MB)
            rows_times_weight<MB>(c.data() + i * K, dx.data() + i * blocks, sx.data() + i * mb, qn, d + n * blocks,
                                  HAS_M ? m + n * mb : m, y + i * N + n, K, N, mb);
        const int64_t left = M - i;  // the last rows in one tile too: each tile decodes the weight row once
        if (left == 3)
            rows_times_weight<3>(c.data() + i * K, dx.data() + i * blocks, sx.data() + i * mb, qn, d + n * blocks,
                                 HAS_M ? m + n * mb : m, y + i * N + n, K, N, mb);
        else if (left == 2)
            rows_times_weight<2>(c.data() + i * K, dx.data() + i * blocks, sx.data() + i * mb, qn, d + n * blocks,
                                 HAS_M ? m + n * mb : m, y + i * N + n, K, N, mb);
        else if (left == 1)
            rows_times_weight<1>(c.data() + i * K, dx.data() + i * blocks, sx.data() + i * mb, qn, d + n * blocks,
                                 HAS_M ? m + n * mb : m, y + i * N + n, K, N, mb);
    }
    glue::add_residual(y, has_residual ? residual : nullptr, M, N);
}
