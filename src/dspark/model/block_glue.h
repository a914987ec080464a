// The glue of a decoder layer, fused around a block product (block_linear.cpp, block_linear_q8.cpp): what
// the product's input rows are made of (as they are, an RMSNorm of them, or SiLU(gate) * up) and the
// residual stream added to its output. In eager PyTorch these are ~20 small ops a layer, each a few
// microseconds of dispatch on a CPU; here they are a pass over rows the product reads anyway.
//
// Row by row, in a fixed order (at::vec vectors of the CPU's widest ISA): a row's numbers never depend
// on the other rows, so the products stay row-invariant. SiLU(gate) * up is PyTorch's own CPU arithmetic
// (x / (1 + exp(-x)) on Vectorized<float>, then the product), bit for bit F.silu(gate) * up; the
// RMSNorm is HF's (x * rsqrt(mean(x^2) + eps), then times its weight), its sum of squares in vector
// lanes.
#include <torch/csrc/inductor/cpp_prefix.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace glue {

using Vec = at::vec::Vectorized<float>;

enum Prologue : int64_t { AS_IS = 0, RMS_NORM = 1, GLU = 2 };

// x [M, K] (GLU: [M, 2K], gate then up) -> the product's input rows [M, K]: x itself (AS_IS) or
// `scratch`. K is a multiple of 32, so of Vec::size().
static const float* input_rows(const float* x, int64_t M, int64_t K, int64_t prologue, const float* weight,
                               float eps, std::vector<float>& scratch) {
    if (prologue == AS_IS) return x;
    scratch.resize(M * K);
    constexpr int64_t W = Vec::size();
    for (int64_t i = 0; i < M; ++i) {
        float* out = scratch.data() + i * K;
        if (prologue == RMS_NORM) {
            const float* row = x + i * K;
            Vec squares(0.0f);
            for (int64_t k = 0; k < K; k += W) {
                const Vec v = Vec::loadu(row + k);
                squares = squares + v * v;
            }
            const float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, squares);
            const Vec scale(1.0f / std::sqrt(total / static_cast<float>(K) + eps));
            for (int64_t k = 0; k < K; k += W) (Vec::loadu(row + k) * scale * Vec::loadu(weight + k)).store(out + k);
        } else {
            const float* gate = x + i * 2 * K;
            const float* up = gate + K;
            for (int64_t k = 0; k < K; k += W) {
                const Vec g = Vec::loadu(gate + k);
                (g / (Vec(1.0f) + g.neg().exp()) * Vec::loadu(up + k)).store(out + k);
            }
        }
    }
    return scratch.data();
}

// y [M, N] = residual [M, N] + y, where `residual` is given (non-null)
static void add_residual(float* y, const float* residual, int64_t M, int64_t N) {
    if (residual == nullptr) return;
    for (int64_t j = 0; j < M * N; ++j) y[j] = residual[j] + y[j];
}

}  // namespace glue
