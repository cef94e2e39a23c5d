// The causal prompt attention of one layer and the weighted column sums of its probabilities,
// in one pass (fp32): out[j] = Σ_i A[j, i] V[i] and sums[i] = Σ_j w_j A[j, i]. Built by
// kvcompile/kernels/attention_column_sums.py through Inductor's C++ toolchain; the contract
// is in that module's docstring. The queries are the last T of the N keys (T = N: a whole
// prompt; T < N: a chunk of a chunked prompt after the E ≤ N − T entries a layer holds, whose
// per-head logit bias, −inf where a head holds nothing, comes in `bias`).
//
// Work item: (sequence, KV head, block of QB queries). Its G·QB query rows see the keys
// [0, hi) with hi the block's end; their logits are written into a stripe (G·QB × hi floats,
// in the thread's L2), each row's softmax is taken there exactly (its max and sum are known:
// the whole row is in the stripe), the row's share of the column sums is added to the
// thread's accumulator, and the stripe times V gives the output. So the logits are computed
// once, as flash attention computes them, and the score costs one extra multiply-add per
// probability. Both products are register-tiled with the keys and V in L1.
//
// KVzip's reconstruction (kvz_on): the T queries are a reconstruction input read after the N − T cached
// keys, and the kernel also records, for the cached keys i ∈ [w0, w1) (the chunk), the largest log of
// KVzip's attention any row of the work item's KV head gives them: the softmax over KVzip's keys only,
// the sinks [0, sink), the chunk and the own keys [N − T, j], taken from the row's logits in the stripe
// before the model's softmax overwrites them: kvz[i − w0] = max_rows (l_i − m' − log Z') (the caller
// takes exp of it: exp is monotone, so it is the maximum attention itself).
#include <torch/csrc/inductor/cpp_prefix.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// The loader defines KVCOMPILE_D (head dim, a multiple of the vector width) and KVCOMPILE_QB.
constexpr int64_t D = KVCOMPILE_D, QB = KVCOMPILE_QB;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();
static_assert(D % L == 0, "head dim must be a multiple of the vector width");
constexpr int64_t DV = D / L;
constexpr int64_t KB = 64;  // keys per block of the P·V product (a block of V stays in L1)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// s[r][i0 … i0 + W·L) = scale · q_r · k_i for RB rows; kt: the head's keys transposed (D × np).
template <int RB, int W>
static inline void logits_tile(const float* const* q, const float* kt, int64_t np, int64_t i0,
                               float* const* s, float scale) {
    Vec acc[RB][W];
    for (int r = 0; r < RB; ++r)
        for (int w = 0; w < W; ++w) acc[r][w] = Vec(0.f);
    for (int64_t e = 0; e < D; ++e) {
        Vec k[W];
        for (int w = 0; w < W; ++w) k[w] = Vec::loadu(kt + e * np + i0 + w * L);
        for (int r = 0; r < RB; ++r) {
            const Vec qe(q[r][e]);
            for (int w = 0; w < W; ++w) acc[r][w] = at::vec::fmadd(qe, k[w], acc[r][w]);
        }
    }
    const Vec sc(scale);
    for (int r = 0; r < RB; ++r)
        for (int w = 0; w < W; ++w) (acc[r][w] * sc).store(s[r] + i0 + w * L);
}

// o[r] += Σ_{i ∈ [i0, i1)} p_r[i] v[i] for RB rows (o: the rows' running outputs, D floats each).
template <int RB>
static inline void pv_tile(const float* const* p, const float* v, int64_t i0, int64_t i1, float* const* o) {
    Vec acc[RB][DV];
    for (int r = 0; r < RB; ++r)
        for (int64_t c = 0; c < DV; ++c) acc[r][c] = Vec::loadu(o[r] + c * L);
    for (int64_t i = i0; i < i1; ++i) {
        Vec vi[DV];
        for (int64_t c = 0; c < DV; ++c) vi[c] = Vec::loadu(v + i * D + c * L);
        for (int r = 0; r < RB; ++r) {
            const Vec pi(p[r][i]);
            for (int64_t c = 0; c < DV; ++c) acc[r][c] = at::vec::fmadd(pi, vi[c], acc[r][c]);
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int64_t c = 0; c < DV; ++c) acc[r][c].store(o[r] + c * L);
}

static inline float row_max(const float* s, int64_t n) {
    Vec m(NEG_INF);
    int64_t i = 0;
    for (; i + L <= n; i += L) m = at::vec::maximum(m, Vec::loadu(s + i));
    float out = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, m);
    for (; i < n; ++i) out = std::max(out, s[i]);
    return out;
}

// Σ_{i < n} exp(s[i] − m), s left as is.
static inline float exp_total(const float* s, int64_t n, float m) {
    const Vec mv(m);
    Vec total(0.f);
    int64_t i = 0;
    for (; i + L <= n; i += L) total = total + (Vec::loadu(s + i) - mv).exp();
    float out = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
    for (; i < n; ++i) out += std::exp(s[i] - m);
    return out;
}

// acc[i] ← max(acc[i], s[i] − c) for i < n.
static inline void max_shifted(float* acc, const float* s, int64_t n, float c) {
    const Vec cv(c);
    int64_t i = 0;
    for (; i + L <= n; i += L) at::vec::maximum(Vec::loadu(acc + i), Vec::loadu(s + i) - cv).store(acc + i);
    for (; i < n; ++i) acc[i] = std::max(acc[i], s[i] - c);
}

// s[i] ← exp(s[i] − m) for i < n; returns their sum.
static inline float exp_sum(float* s, int64_t n, float m) {
    const Vec mv(m);
    Vec total(0.f);
    int64_t i = 0;
    for (; i + L <= n; i += L) {
        const Vec e = (Vec::loadu(s + i) - mv).exp();
        e.store(s + i);
        total = total + e;
    }
    float out = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
    for (; i < n; ++i) {
        s[i] = std::exp(s[i] - m);
        out += s[i];
    }
    return out;
}

// acc[i] += c · s[i] for i < n.
static inline void axpy(float* acc, const float* s, int64_t n, float c) {
    const Vec cv(c);
    int64_t i = 0;
    for (; i + L <= n; i += L) at::vec::fmadd(cv, Vec::loadu(s + i), Vec::loadu(acc + i)).store(acc + i);
    for (; i < n; ++i) acc[i] += c * s[i];
}

// q (B, H·G, T, D) the queries of the last T keys (T ≤ N), kt (B, H, D, NP) the keys transposed
// with NP ≥ N a multiple of L (zeros past N), v (B, H, N, D), valid (B, N) 1 = real token (read
// when has_mask), bias (B, H, E) the logit bias of the first E keys (E = 0: none), w (T,) the row
// weights; out (B, H·G, T, D); partial (threads, B, H·G, N) zeros: each thread's column sums
// (the caller adds them up); stripe (threads, G·QB, NP) scratch. Query t is key j = N − T + t: it
// sees the keys i ≤ j that are real (i < j; itself always), the first E with their bias; a pad
// query sees none of the first E. kvz (threads, B, H, w1 − w0) −inf: each thread's KVzip maxima, read
// when kvz_on (no mask, no bias; sink ≤ w0 ≤ w1 ≤ N − T).
extern "C" void kernel(const float* q, const float* kt, const float* v, const int64_t* valid, const float* bias,
                       const float* w, float* out, float* partial, float* stripe, float* kvz, const int64_t B,
                       const int64_t H, const int64_t G, const int64_t N, const int64_t T, const int64_t E,
                       const int64_t NP, const float scale, const int64_t has_mask, const int64_t kvz_on,
                       const int64_t sink, const int64_t w0, const int64_t w1, const int64_t threads) {
    const int64_t blocks = (T + QB - 1) / QB, BH = B * H, offset = N - T;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if(threads > 1)
    for (int64_t item = 0; item < BH * blocks; ++item) {
        const int64_t blk = blocks - 1 - item / BH, bh = item % BH, b = bh / H;  // longest rows first
        const int64_t lo = blk * QB, hi = std::min(lo + QB, T), c = hi - lo, rows = G * c;
        const int64_t end = offset + hi;  // the block's last query sees the keys [0, end)
        const int64_t kn = (end + L - 1) / L * L;  // keys computed (a whole vector past end: zero keys)
        const int thread = omp_get_thread_num();
        float* s0 = stripe + thread * G * QB * NP;
        float* sums = partial + (thread * B * H * G + bh * G) * N;  // (G, N) of this KV head
        const float* k_t = kt + bh * D * NP;
        const float* vh = v + bh * N * D;
        const float* held = E ? bias + bh * E : nullptr;
        const int64_t* real = has_mask ? valid + b * N : nullptr;
        float* best = kvz_on ? kvz + (thread * BH + bh) * (w1 - w0) : nullptr;  // (w1 − w0) of this KV head
        std::vector<const float*> qr(rows);
        std::vector<float*> sr(rows), orow(rows);
        std::vector<int64_t> len(rows);
        std::vector<float> inv(rows);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t g = r / c, t = lo + r % c;
            qr[r] = q + ((bh * G + g) * T + t) * D;
            sr[r] = s0 + r * NP;
            orow[r] = out + ((bh * G + g) * T + t) * D;
            len[r] = offset + t + 1;
        }
        // logits: key tiles outer (a tile of kt stays in L1), rows inner
        int64_t i0 = 0;
        for (; i0 + 2 * L <= kn; i0 += 2 * L) {
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4) logits_tile<4, 2>(qr.data() + r, k_t, NP, i0, sr.data() + r, scale);
            for (; r < rows; ++r) logits_tile<1, 2>(qr.data() + r, k_t, NP, i0, sr.data() + r, scale);
        }
        if (i0 < kn) {
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4) logits_tile<4, 1>(qr.data() + r, k_t, NP, i0, sr.data() + r, scale);
            for (; r < rows; ++r) logits_tile<1, 1>(qr.data() + r, k_t, NP, i0, sr.data() + r, scale);
        }
        // each row's softmax over its visible keys (i ≤ j, real or itself), its column sums
        for (int64_t r = 0; r < rows; ++r) {
            float* s = sr[r];
            const int64_t n = len[r], j = n - 1, t = j - offset;
            const bool real_query = real == nullptr || real[j];
            if (best != nullptr) {  // KVzip's softmax over the sinks, the chunk and the own keys ≤ j
                const float m = std::max({row_max(s, sink), row_max(s + w0, w1 - w0), row_max(s + offset, n - offset)});
                const float z = exp_total(s, sink, m) + exp_total(s + w0, w1 - w0, m) +
                                exp_total(s + offset, n - offset, m);
                max_shifted(best, s + w0, w1 - w0, m + std::log(z));
            }
            if (held != nullptr) {  // the held entries: their bias (none for a pad query)
                const int64_t e_end = std::min(E, j);
                if (real_query) axpy(s, held, e_end, 1.f);
                else std::fill(s, s + e_end, NEG_INF);
            }
            if (real != nullptr)
                for (int64_t i = 0; i < j; ++i)
                    if (!real[i]) s[i] = NEG_INF;
            const float sum = exp_sum(s, n, row_max(s, n));
            std::fill(s + n, s + kn, 0.f);
            inv[r] = 1.f / sum;
            const int64_t g = r / c;
            if (real_query && w[t] != 0.f) axpy(sums + g * N, s, n, w[t] * inv[r]);
            for (int64_t e = 0; e < D; ++e) orow[r][e] = 0.f;
        }
        // out = P·V / sum, V in blocks of KB keys (held in L1 across the rows)
        for (int64_t k0 = 0; k0 < end; k0 += KB) {
            const int64_t k1 = std::min(k0 + KB, end);
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4) pv_tile<4>(sr.data() + r, vh, k0, k1, orow.data() + r);
            for (; r < rows; ++r) pv_tile<1>(sr.data() + r, vh, k0, k1, orow.data() + r);
        }
        for (int64_t r = 0; r < rows; ++r) {
            const Vec scale_r(inv[r]);  // the stripe holds unnormalised probabilities
            for (int64_t cc = 0; cc < DV; ++cc) (Vec::loadu(orow[r] + cc * L) * scale_r).store(orow[r] + cc * L);
        }
    }
}
