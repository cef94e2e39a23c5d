// Decode attention of compressed requests over their packed entries in vLLM's CPU cache (fp32).
// Built by kvcompile/integrations/vllm/packed_attention.py through Inductor's C++ toolchain; the layout, the runs
// and the contract are in that module's docstring.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <limits>

// The loader defines KVCOMPILE_G (query heads per KV head) and KVCOMPILE_D (head dim) before this file:
// one build per (G, D), so the G * D / L accumulators stay in registers.
constexpr int64_t G = KVCOMPILE_G, D = KVCOMPILE_D;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();
static_assert(D % L == 0, "head dim must be a multiple of the vector width");
constexpr int64_t DV = D / L;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Head {  // one query row's running softmax for the G query heads of one KV head
    float q[G][D];  // scaled query
    float m[G], l[G];
    Vec acc[G][DV];
};

// n <= L consecutive entries of one (block, KV head) cell at offsets [o, o + n): keys at cell[i * BS + o]
// (each dimension's keys contiguous over the block), values at cell[BS * D + o * D + i].
static inline void attend_lanes(Head& h, const float* cell, int64_t BS, int64_t o, int64_t n) {
    const Vec lane = Vec::arange(0.f, 1.f);
    const Vec live = lane < Vec(float(n));
    Vec dot[G];
    for (int64_t g = 0; g < G; ++g) dot[g] = Vec(0.f);
    for (int64_t i = 0; i < D; ++i) {
        const Vec k = n == L ? Vec::loadu(cell + i * BS + o) : Vec::loadu(cell + i * BS + o, n);
        for (int64_t g = 0; g < G; ++g) dot[g] = at::vec::fmadd(Vec(h.q[g][i]), k, dot[g]);
    }
    alignas(64) float p[G][L];
    for (int64_t g = 0; g < G; ++g) {
        const Vec logits = Vec::blendv(Vec(NEG_INF), dot[g], live);
        const float chunk_max = at::vec::vec_reduce_all<float>(
            [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, logits);
        const float m_new = std::max(h.m[g], chunk_max);
        const float rescale = std::exp(h.m[g] - m_new);  // 0 while m was -inf
        const Vec e = (logits - Vec(m_new)).exp();  // dead lanes: exp(-inf) = 0
        e.store(p[g]);
        h.l[g] = h.l[g] * rescale + at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, e);
        h.m[g] = m_new;
        for (int64_t j = 0; j < DV; ++j) h.acc[g][j] = h.acc[g][j] * Vec(rescale);
    }
    const float* values = cell + BS * D + o * D;
    for (int64_t s = 0; s < n; ++s)
        for (int64_t j = 0; j < DV; ++j) {
            const Vec v = Vec::loadu(values + s * D + j * L);
            for (int64_t g = 0; g < G; ++g) h.acc[g][j] = at::vec::fmadd(Vec(p[g][s]), v, h.acc[g][j]);
        }
}

static inline void attend_run(Head& h, const float* cell, int64_t BS, int64_t o, int64_t n) {
    for (int64_t s = 0; s < n; s += L) attend_lanes(h, cell, BS, o + s, std::min<int64_t>(L, n - s));
}

// caches: each layer's cache tensor's address; runs (R, 4): (layer tensor, cell = block * H + column,
// first offset, length); head_runs (B * H, 2): this layer's runs of request b, KV head h are
// [head_runs[2 (b * H + h)], head_runs[2 (b * H + h) + 1]); requests (B, 5): (first query row, query rows T,
// prompt length N, position of the first query row, block-table row). Query row t of request b at
// position p attends its head's runs, then the decode entries at positions [N, p] of this layer's own
// cache (column h), found through the block table. out row r: G * H heads of D, from query row r.
extern "C" void kernel(const float* query, const int64_t q_stride, float* out, const int64_t out_stride,
                       const int64_t* caches, const int64_t layer, const int64_t* runs,
                       const int64_t* head_runs, const int64_t* requests, const int64_t* block_table,
                       const int64_t table_stride, const int64_t B, const int64_t H, const int64_t BS,
                       const float scale, const int64_t threads) {
    const int64_t cell_size = BS * 2 * D;
    const float* own = reinterpret_cast<const float*>(caches[layer]);
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if(threads > 1)
    for (int64_t item = 0; item < B * H; ++item) {
        const int64_t b = item / H, kv = item % H;
        const int64_t* r = requests + b * 5;
        const int64_t row0 = r[0], T = r[1], N = r[2], first = r[3];
        const int64_t* table = block_table + r[4] * table_stride;
        for (int64_t t = 0; t < T; ++t) {
            Head h;
            const float* q = query + (row0 + t) * q_stride + kv * G * D;
            for (int64_t g = 0; g < G; ++g) {
                for (int64_t i = 0; i < D; ++i) h.q[g][i] = q[g * D + i] * scale;
                h.m[g] = NEG_INF; h.l[g] = 0.f;
                for (int64_t j = 0; j < DV; ++j) h.acc[g][j] = Vec(0.f);
            }
            for (int64_t u = head_runs[2 * item]; u < head_runs[2 * item + 1]; ++u) {
                const int64_t* run = runs + u * 4;
                const float* base = reinterpret_cast<const float*>(caches[run[0]]);
                attend_run(h, base + run[1] * cell_size, BS, run[2], run[3]);
            }
            const int64_t last = first + t;  // decode entries [N, last], block by block
            for (int64_t pos = N; pos <= last; ) {
                const int64_t o = pos % BS, n = std::min<int64_t>(BS - o, last + 1 - pos);
                attend_run(h, own + (table[pos / BS] * H + kv) * cell_size, BS, o, n);
                pos += n;
            }
            float* o = out + (row0 + t) * out_stride + kv * G * D;
            for (int64_t g = 0; g < G; ++g) {
                const Vec inv = Vec(h.l[g] > 0.f ? 1.f / h.l[g] : 0.f);  // a head with nothing gives zeros
                for (int64_t j = 0; j < DV; ++j) (h.acc[g][j] * inv).store(o + g * D + j * L);
            }
        }
    }
}
