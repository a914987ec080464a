// Decode-shaped attention of a batch of ragged rows (see decode_attention.py for why it exists).
//
// Built by PyTorch Inductor's own C++ toolchain (CppPythonBindingsCodeCache): its prefix header brings
// at::vec::Vectorized for the CPU's widest ISA. The loader defines DSPARK_T (the cache's element type)
// and DSPARK_D (the head dimension, a multiple of the vector width) before this file.
//
// Row b brings count[b] query tokens at positions start[b], start[b] + 1, ...; its token i attends to
// the row's first start[b] + i + 1 cached positions (its own K/V already written), nothing beyond: the
// cache past a row's length is never read. A token tree's row (`seen` given) has its nodes' K/V in slots
// start[b] + j; node i attends to the row's context and to the nodes whose bit j of seen[b, i] is set (its
// ancestors and itself), summed as if they followed the context contiguously: exactly what the same token
// decoded alone, after its path was accepted, computes. Task (b, h, i) = row b, K/V head h, token i, with the
// query heads of its group (folded GQA). fp32 throughout, exp as PyTorch's flash kernel computes it (exp_u20).
// One pass over K, one over V:
//   scores s[m][l] = q[m] . k[l] * scale;  p = softmax over l < L_m;  out[m] = sum_l p[m][l] v[l]
#include <torch/csrc/inductor/cpp_prefix.h>

#include <limits>
#include <type_traits>
#include <vector>

using bfloat16 = at::BFloat16;
using T = DSPARK_T;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t D = DSPARK_D;
constexpr int64_t C = D / W;  // vectors in a head
constexpr int64_t MAX_GROUP = 8;
static_assert(D % W == 0, "head dimension must be a multiple of the vector width");

static inline Vec load_float(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
        return Vec::loadu(p);
    } else {
        return at::vec::convert<float>(at::vec::Vectorized<T>::loadu(p, W));
    }
}

static inline void store(Vec v, T* p) {
    if constexpr (std::is_same_v<T, float>) {
        v.store(p);
    } else {
        at::vec::convert<T>(v).store(p, W);
    }
}

static inline float sum_all(Vec v) {
    return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

static inline float max_all(Vec v) {
    return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, v);
}

// The positions a token attends, in order: the first `context` cached slots, then the `npath` slots in
// `path` (a tree node's ancestors and itself, by depth). Index l of them lives in slot `slot(l)`, so a tree
// node sums exactly as the same token decoded alone does over its contiguous positions.
struct Seen {
    int64_t context, npath;
    const int64_t* path;
    int64_t length() const { return context + npath; }
    int64_t slot(int64_t l) const { return l < context ? l : path[l - context]; }
};

// scores[g * L + l] = q[g] . K[slot(l)] * scale
static void scores_of(const T* qh, const T* K, const Seen& seen, int64_t group, float scale, float* scores) {
    const int64_t L = seen.length();
    Vec q[MAX_GROUP][C];
    for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < C; ++c) q[g][c] = load_float(qh + g * D + c * W) * Vec(scale);
    for (int64_t l = 0; l < L; ++l) {
        const T* kl = K + seen.slot(l) * D;
        Vec k[C];
        for (int64_t c = 0; c < C; ++c) k[c] = load_float(kl + c * W);
        for (int64_t g = 0; g < group; ++g) {
            Vec s = q[g][0] * k[0];
            for (int64_t c = 1; c < C; ++c) s = at::vec::fmadd(q[g][c], k[c], s);
            scores[g * L + l] = sum_all(s);
        }
    }
}

// s[0..L) -> exp(s - max), returns 1 / their sum
static float softmax_in_place(float* s, int64_t L) {
    Vec vmax(-std::numeric_limits<float>::infinity());
    int64_t l = 0;
    for (; l + W <= L; l += W) vmax = at::vec::maximum(vmax, Vec::loadu(s + l));
    float m = max_all(vmax);
    for (; l < L; ++l) m = std::max(m, s[l]);
    Vec vsum(0.f);
    for (l = 0; l + W <= L; l += W) {
        Vec e = (Vec::loadu(s + l) - Vec(m)).exp_u20();
        e.store(s + l);
        vsum = vsum + e;
    }
    float sum = sum_all(vsum);
    for (; l < L; ++l) {
        s[l] = std::exp(s[l] - m);
        sum += s[l];
    }
    return 1.f / sum;
}

// out[g] = sum_l p[g][l] V[slot(l)] / sum_l p[g][l]
static void weighted_values(const float* p, const float* inv_sum, const T* V, const Seen& seen, int64_t group,
                            T* oh) {
    const int64_t L = seen.length();
    Vec acc[MAX_GROUP][C];
    for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < C; ++c) acc[g][c] = Vec(0.f);
    for (int64_t l = 0; l < L; ++l) {
        const T* vl = V + seen.slot(l) * D;
        Vec v[C];
        for (int64_t c = 0; c < C; ++c) v[c] = load_float(vl + c * W);
        for (int64_t g = 0; g < group; ++g) {
            Vec pg(p[g * L + l]);
            for (int64_t c = 0; c < C; ++c) acc[g][c] = at::vec::fmadd(pg, v[c], acc[g][c]);
        }
    }
    for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < C; ++c) store(acc[g][c] * Vec(inv_sum[g]), oh + g * D + c * W);
}

// One token's group of query heads attending to the positions `seen` lists of one K/V head.
static void attend(const T* qh, const T* K, const T* V, T* oh, const Seen& seen, int64_t group, float scale,
                   std::vector<float>& scores) {
    float inv_sum[MAX_GROUP];
    const int64_t L = seen.length();
    scores.resize(group * L);
    scores_of(qh, K, seen, group, scale, scores.data());
    for (int64_t g = 0; g < group; ++g) inv_sum[g] = softmax_in_place(scores.data() + g * L, L);
    weighted_values(scores.data(), inv_sum, V, seen, group, oh);
}

// q, out [B, Q, nkv * group, D] contiguous: row b's count[b] <= Q tokens first (the rest's outputs are
// zeros); kv [B, 2 * nkv, max_len, D] with row / head strides (K heads first, then V heads), positions
// contiguous; seen [B, Q] (read when `tree`): each tree node's visible nodes, a bit each.
extern "C" void kernel(const T* q, const T* kv, const int64_t* start, const int64_t* count, const int64_t* seen,
                       T* out, int64_t B, int64_t Q, int64_t nkv, int64_t group, int64_t row_stride,
                       int64_t head_stride, float scale, int64_t tree, int64_t threads) {
    const int64_t heads = nkv * group;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < B * nkv * Q; ++t) {  // a task a token and K/V head: a verify row's Q tokens
            const int64_t b = t / (nkv * Q), h = t / Q % nkv, i = t % Q;  // spread over the threads too
            const T* K = kv + b * row_stride + h * head_stride;
            const T* V = kv + b * row_stride + (nkv + h) * head_stride;
            const int64_t offset = ((b * Q + i) * heads + h * group) * D;
            if (i < count[b]) {
                int64_t path[64], npath = 0;  // a tree node's visible nodes' slots, in node order
                if (tree)
                    for (int64_t j = 0; j < count[b]; ++j)
                        if ((static_cast<uint64_t>(seen[b * Q + i]) >> j) & 1) path[npath++] = start[b] + j;
                const Seen positions{tree ? start[b] : start[b] + i + 1, npath, path};
                attend(q + offset, K, V, out + offset, positions, group, scale, scores);
            } else {
                std::fill(out + offset, out + offset + group * D, T(0));
            }
        }
    }
}
