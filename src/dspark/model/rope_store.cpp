// RoPE on a layer's new queries and keys, and the keys and values written into its K/V cache: one call
// where eager PyTorch runs ~10 small ops a layer (the fp32 block modes' layers, transformer.py).
//
// HF's rotate-half RoPE in its own arithmetic: out = x * cos + rotate_half(x) * sin, rotate_half(x) =
// (-x[d/2:], x[:d/2]), one rounding per operation (built with -ffp-contract=off, as Inductor builds), so
// the rotated rows are bit for bit apply_rope's.
#include <torch/csrc/inductor/cpp_prefix.h>

#include <cstdint>

// qkv [N, nh + 2 nkv, D] (each token's projections), cos / sin [positions, D] -> q [N, nh, D] rotated; token t's
// rotated K heads and its V heads written to cache position slots[t] of row rows[t]: cache + rows[t] *
// row_stride + head * head_stride + slots[t] * D, K heads 0..nkv-1 then V heads nkv..2 nkv-1.
extern "C" void kernel(const float* qkv, const float* cos, const float* sin, const int64_t* pos, const int64_t* rows,
                       const int64_t* slots, float* q, float* cache, int64_t N, int64_t nh, int64_t nkv, int64_t D,
                       int64_t row_stride, int64_t head_stride) {
    const int64_t half = D / 2, width = (nh + 2 * nkv) * D;
    for (int64_t t = 0; t < N; ++t) {
        const float* c = cos + pos[t] * D;
        const float* s = sin + pos[t] * D;
        float* row = cache + rows[t] * row_stride + slots[t] * D;
        for (int64_t h = 0; h < nh + 2 * nkv; ++h) {
            const float* x = qkv + t * width + h * D;
            float* out = h < nh ? q + (t * nh + h) * D : row + (h - nh) * head_stride;
            if (h >= nh + nkv) {  // a V head: as it is
                for (int64_t i = 0; i < D; ++i) out[i] = x[i];
                continue;
            }
            for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
            for (int64_t i = half; i < D; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
        }
    }
}
