// Decode attention of compressed requests over their packed entries in vLLM's CPU cache (fp32), the entries
// stored in the cache's dtype or as int8 / int4 codes. Built by kvcompile/integrations/vllm/packed_attention.py
// through Inductor's C++ toolchain after paged_attention.cpp's text (its entry renamed), whose constants (G, D,
// the vector Vec of L lanes, the key and value groups GK = GV) and work item over codes (`partial<BITS>`: the
// codes dequantized in registers) this file uses; the layout, the runs and the contract are in that module's
// docstring.
static_assert(KVCOMPILE_FLOAT || (!KCH && GK == GV), "packed codes: keys and values per token, one group size");

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
        const float chunk_max = hmax(logits);
        const float m_new = std::max(h.m[g], chunk_max);
        const float rescale = std::exp(h.m[g] - m_new);  // 0 while m was -inf
        const Vec e = (logits - Vec(m_new)).exp();  // dead lanes: exp(-inf) = 0
        e.store(p[g]);
        h.l[g] = h.l[g] * rescale + hsum(e);
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

#if !KVCOMPILE_FLOAT
// A head's packed entries as codes, gathered from its layer's byte string into the arrays `partial<BITS>` reads:
// the codes (K * W bytes) and scales and zero points (K * GROUPS floats) of the keys and of the values, in
// pages of PAGE entries (pages[p] = p).
constexpr int64_t PAGE = 16, GROUPS = D / GK;
struct Codes {
    std::vector<uint8_t> kc, vc;
    std::vector<float> ks, kz, vs, vz;
    std::vector<int64_t> pages;
};

// Entries [e0, e0 + K) of a layer's byte string (kvcompile/integrations/vllm/codes.py: an entry is its key's and
// its value's codes, W bytes each, then the key's scales and zeros and the value's, GROUPS floats each; the string
// cut into slots of 2 * D words, a slot's word i < D at its key dimension i, cell[i * BS + o], and word D + i at
// its value channel i, cell[BS * D + o * D + i]); its slots in order are the cells' offsets of `runs`
// [r0, r1) ((layer tensor, cell, first offset, length) each). The slots holding them are copied into one string
// (a run's keys a dimension at a time: contiguous over its offsets), then its entries cut into the arrays.
template <int BITS>
static void gather_codes(Codes& c, const int64_t* caches, const int64_t* runs, int64_t r0, int64_t r1, int64_t e0,
                         int64_t K, int64_t BS) {
    constexpr int64_t W = D * BITS / 8, SW = 2 * D;  // bytes of an entry's codes, words of a slot
    constexpr int64_t EB = 2 * W + 16 * GROUPS;  // bytes of an entry
    static_assert(EB % 4 == 0, "an entry is whole words");
    const int64_t lo = e0 * EB / 4, hi = (e0 + K) * EB / 4;  // the entries' words of the string
    const int64_t first = lo / SW, end = (hi + SW - 1) / SW;  // the string's slots holding them
    std::vector<uint32_t> words((end - first) * SW);
    for (int64_t u = r0, slot = 0; u < r1 && slot < end; slot += runs[u * 4 + 3], ++u) {
        const int64_t* run = runs + u * 4;
        const int64_t a = std::max(slot, first), b = std::min(slot + run[3], end);  // the run's slots taken
        if (a >= b) continue;
        const uint32_t* cell = reinterpret_cast<const uint32_t*>(caches[run[0]]) + run[1] * BS * SW;
        const int64_t o = run[2] + a - slot;
        uint32_t* to = words.data() + (a - first) * SW;
        for (int64_t i = 0; i < D; ++i)
            for (int64_t s = 0; s < b - a; ++s) to[s * SW + i] = cell[i * BS + o + s];
        for (int64_t s = 0; s < b - a; ++s) std::memcpy(to + s * SW + D, cell + BS * D + (o + s) * D, D * 4);
    }
    c.kc.resize(K * W); c.vc.resize(K * W);
    c.ks.resize(K * GROUPS); c.kz.resize(K * GROUPS); c.vs.resize(K * GROUPS); c.vz.resize(K * GROUPS);
    const uint8_t* entry = reinterpret_cast<const uint8_t*>(words.data() + (lo - first * SW));
    for (int64_t e = 0; e < K; ++e, entry += EB) {
        std::memcpy(c.kc.data() + e * W, entry, W);
        std::memcpy(c.vc.data() + e * W, entry + W, W);
        float* floats[4] = {c.ks.data(), c.kz.data(), c.vs.data(), c.vz.data()};
        for (int64_t f = 0; f < 4; ++f)
            std::memcpy(floats[f] + e * GROUPS, entry + 2 * W + f * GROUPS * 4, GROUPS * 4);
    }
    c.pages.resize((K + PAGE - 1) / PAGE);
    for (int64_t p = 0; p < int64_t(c.pages.size()); ++p) c.pages[p] = p;
}

// Request b's new tokens at KV head kv, positions [from, to) of this layer's cache `own`: their keys and values, as
// vLLM wrote them, replaced by x̂ = code * scale + zero, what kvcompile stores of them (append_step.cpp's
// `quantize_entry`, kvcompile/kernels/quantize.py's quantizer bit for bit, then its dequantization: a product,
// then a sum), before any attention reads them.
template <int BITS>
static void store_new(float* own, const int64_t* table, int64_t kv, int64_t H, int64_t BS, int64_t from, int64_t to) {
    for (int64_t pos = from; pos < to; ++pos) {
        float* cell = own + (table[pos / BS] * H + kv) * BS * 2 * D;
        const int64_t o = pos % BS;
        for (int64_t half = 0; half < 2; ++half) {  // the key (dimension i at cell[i * BS + o]), then the value
            float* x = half ? cell + BS * D + o * D : cell + o;
            const int64_t step = half ? 1 : BS;
            float entry[D], scale[GROUPS], zero[GROUPS];
            uint8_t codes[D * BITS / 8];
            for (int64_t i = 0; i < D; ++i) entry[i] = x[i * step];
            quantize_entry<BITS, GK>(entry, codes, scale, zero);
            for (int64_t i = 0; i < D; ++i) {
                const int64_t code = BITS == 8 ? codes[i] : (codes[i / 2] >> (4 * (i % 2))) & 0xF;
                x[i * step] = float(code) * scale[i / GK] + zero[i / GK];
            }
        }
    }
}

// Query row q's G heads over the gathered entries: the paged kernel's work item, its m, l and accumulators
// taken as h's.
template <int BITS>
static void attend_codes(Head& h, const float* q, float scale, Codes& c, int64_t K) {
    std::vector<float> logit(G * PAGE), dots(G * PAGE * L);
    alignas(64) float acc[G * D];
    partial<BITS>(q, scale, c.kc.data(), c.ks.data(), c.kz.data(), c.vc.data(), c.vs.data(), c.vz.data(),
                  c.pages.data(), nullptr, 0, int64_t(c.pages.size()), PAGE, 0, K, logit.data(), dots.data(), h.m,
                  h.l, acc);
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < DV; ++j) h.acc[g][j] = Vec::loadu(acc + g * D + j * L);
}
#endif

// caches: each layer's cache tensor's address; runs (R, 4): (layer tensor, cell = block * H + column,
// first offset, length); heads (B * H, 4): request b's KV head h at this layer reads runs [heads[4 (b * H + h)],
// heads[4 (b * H + h) + 1]), entries [heads[.. + 2], + heads[.. + 3]) of them: for fp32 entries (bits 32) the
// runs are the head's entries (the entry columns unread); for codes (bits 8, 4) they are the slots of the layer's
// byte string, and the entries those of the string. requests (B, 5): (first query row, query rows T, prompt
// length N, position of the first query row, block-table row). Query row t of request b at position p attends
// its head's packed entries, then the decode entries at positions [N, p] of this layer's own cache (column h,
// fp32), found through the block table. out row r: G * H heads of D, from query row r.
extern "C" void kernel(const float* query, const int64_t q_stride, float* out, const int64_t out_stride,
                       const int64_t* caches, const int64_t layer, const int64_t* runs, const int64_t* heads,
                       const int64_t* requests, const int64_t* block_table, const int64_t table_stride,
                       const int64_t B, const int64_t H, const int64_t BS, const float scale, const int64_t threads,
                       const int64_t bits) {
    const int64_t cell_size = BS * 2 * D;
    const float* own = reinterpret_cast<const float*>(caches[layer]);
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if(threads > 1)
    for (int64_t item = 0; item < B * H; ++item) {
        const int64_t b = item / H, kv = item % H;
        const int64_t* r = requests + b * 5;
        const int64_t row0 = r[0], T = r[1], N = r[2], first = r[3];
        const int64_t* table = block_table + r[4] * table_stride;
        const int64_t* head = heads + 4 * item;
#if !KVCOMPILE_FLOAT
        Codes codes;
        float* mine = const_cast<float*>(own);  // the new tokens' slots: this item's alone
        if (bits == 8) {
            store_new<8>(mine, table, kv, H, BS, std::max(first, N), first + T);
            gather_codes<8>(codes, caches, runs, head[0], head[1], head[2], head[3], BS);
        }
        if (bits == 4) {
            store_new<4>(mine, table, kv, H, BS, std::max(first, N), first + T);
            gather_codes<4>(codes, caches, runs, head[0], head[1], head[2], head[3], BS);
        }
#endif
        for (int64_t t = 0; t < T; ++t) {
            Head h;
            const float* q = query + (row0 + t) * q_stride + kv * G * D;
            for (int64_t g = 0; g < G; ++g) {
                for (int64_t i = 0; i < D; ++i) h.q[g][i] = q[g * D + i] * scale;
                h.m[g] = NEG_INF; h.l[g] = 0.f;
                for (int64_t j = 0; j < DV; ++j) h.acc[g][j] = Vec(0.f);
            }
            if (bits == 32) {
                for (int64_t u = head[0]; u < head[1]; ++u) {
                    const int64_t* run = runs + u * 4;
                    const float* base = reinterpret_cast<const float*>(caches[run[0]]);
                    attend_run(h, base + run[1] * cell_size, BS, run[2], run[3]);
                }
            }
#if !KVCOMPILE_FLOAT
            else if (head[3] > 0) {
                if (bits == 8) attend_codes<8>(h, q, scale, codes, head[3]);
                else attend_codes<4>(h, q, scale, codes, head[3]);
            }
#endif
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
