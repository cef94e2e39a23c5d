// Paged decode attention on the CPU: flash-decoding over each head's pages (fp32).
// Built by kvcompile/kernels/paged_attention_cpp.py through Inductor's C++ toolchain;
// the contract and the design are in that module's docstring.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <limits>
#include <vector>

// The loader (paged_attention_cpp.py) defines KVCOMPILE_G, KVCOMPILE_D and KVCOMPILE_AHEAD before
// this file: one build per (G, D), so the G * D / L accumulators stay in registers.
constexpr int64_t G = KVCOMPILE_G, D = KVCOMPILE_D, AHEAD = KVCOMPILE_AHEAD;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();
static_assert(D % L == 0, "head dim must be a multiple of the vector width");
constexpr int64_t DV = D / L;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

#if defined(CPU_CAPABILITY_AVX512)
// Lane i of the result = the sum of rows[16 i .. 16 i + 15], for 16 rows: a transpose-and-add
// tree (45 instructions) instead of 16 horizontal sums (each a chain of 8 dependent ones).
static inline __m512 lane_sums16(const float* rows) {
    __m512 v[16], a[8], c[4];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(rows + 16 * i);
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the partial sums of v[4i .. 4i+3]
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}
constexpr bool TREE = true;
#else
constexpr bool TREE = false;
#endif

// Online-softmax step of query head g over one page's logits [first, last) (in row[0..S)):
// row becomes the page's exp(logit - m_new) (zeros while m is -inf); m, l and the
// accumulators are rescaled. whole: row is one vector (S == L) whose lanes outside
// [first, last) hold -inf, so max, exp and sum run on the vector.
static inline void softmax_step(float* row, int64_t first, int64_t last, bool whole, float& m, float& l,
                                Vec* acc) {
    float page_max = NEG_INF;
    if (whole)
        page_max = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); },
                                                  Vec::loadu(row));
    else
        for (int64_t s = first; s < last; ++s) page_max = std::max(page_max, row[s]);
    const float m_new = std::max(m, page_max);
    if (m_new == NEG_INF) {  // nothing finite yet (bias -inf): no weight
        for (int64_t s = first; s < last; ++s) row[s] = 0.f;
        return;
    }
    const float rescale = std::exp(m - m_new);  // 0 when m = -inf
    float sum = 0.f;
    if (whole) {  // one vectorised exp per page; the -inf lanes give 0
        const Vec p = (Vec::loadu(row) - Vec(m_new)).exp();
        p.store(row);
        sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, p);
    } else {
        for (int64_t s = first; s < last; ++s) { row[s] = std::exp(row[s] - m_new); sum += row[s]; }
    }
    l = l * rescale + sum;
    m = m_new;
    for (int64_t j = 0; j < DV; ++j) acc[j] = acc[j] * Vec(rescale);
}

// One work item: entries [lo, hi) of head bh. Writes m (G), l (G), acc (G, D).
// logit: G * S floats; dots: G * S * L floats (the fast path's dot vectors).
static void partial(const float* q, float scale, const float* kp, const float* vp, const int64_t* table,
                    const float* bias, int64_t bh, int64_t M, int64_t S, int64_t lo, int64_t hi,
                    float* logit, float* dots, float* m_out, float* l_out, float* acc_out) {
    Vec qv[G][DV];
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < DV; ++j) qv[g][j] = Vec::loadu(q + (bh * G + g) * D + j * L) * Vec(scale);
    Vec acc[G][DV];
    float m[G], l[G];
    for (int64_t g = 0; g < G; ++g) {
        m[g] = NEG_INF; l[g] = 0.f;
        for (int64_t j = 0; j < DV; ++j) acc[g][j] = Vec(0.f);
    }
    const bool tree = TREE && S == L;  // a page's logits fill exactly one vector
    for (int64_t start = lo; start < hi; ) {
        const int64_t page = table[bh * M + start / S];
        const int64_t first = start % S;
        const int64_t last = std::min<int64_t>(S, first + (hi - start));
        const float* kpage = kp + page * S * D;
        const float* vpage = vp + page * S * D;
        // A page that does not follow its predecessor in the pool defeats the hardware
        // prefetcher at the boundary: start the loads of the page AHEAD pages further on in
        // this run when the pages up to it do not lie in order (pages in order stream on their
        // own, and the prefetch instructions would only cost issue slots).
        if (start / S + AHEAD < (hi + S - 1) / S) {
            const int64_t next = table[bh * M + start / S + AHEAD];
            if (next != page + AHEAD)
            for (int64_t line = 0; line < S * D; line += 64 / sizeof(float)) {
                __builtin_prefetch(kp + next * S * D + line);
                __builtin_prefetch(vp + next * S * D + line);
            }
        }
        // q.k of each entry as a vector of partial sums (dot[g]), reduced to a logit per entry.
        for (int64_t s = first; s < last; ++s) {
            Vec dot[G];
            for (int64_t g = 0; g < G; ++g) dot[g] = Vec(0.f);
            for (int64_t j = 0; j < DV; ++j) {
                Vec k = Vec::loadu(kpage + s * D + j * L);
                for (int64_t g = 0; g < G; ++g) dot[g] = at::vec::fmadd(qv[g][j], k, dot[g]);
            }
            if (tree) {
                for (int64_t g = 0; g < G; ++g) dot[g].store(dots + (g * S + s) * L);
            } else {
                const float b = bias ? bias[page * S + s] : 0.f;
                for (int64_t g = 0; g < G; ++g)
                    logit[g * S + s] = at::vec::vec_reduce_all<float>(
                        [](Vec& x, Vec& y) { return x + y; }, dot[g]) + b;
            }
        }
#if defined(CPU_CAPABILITY_AVX512)
        if (tree) {  // the page's logits in one vector; lanes outside [first, last) -> -inf
            const Vec lane = Vec::arange(0.f, 1.f);
            const Vec valid = (lane >= Vec(float(first))) & (lane < Vec(float(last)));
            for (int64_t g = 0; g < G; ++g) {
                Vec row = Vec(lane_sums16(dots + g * S * L));
                if (bias) row = row + Vec::loadu(bias + page * S);
                Vec::blendv(Vec(NEG_INF), row, valid).store(logit + g * S);
            }
        }
#endif
        for (int64_t g = 0; g < G; ++g) softmax_step(logit + g * S, first, last, tree, m[g], l[g], acc[g]);
        for (int64_t s = first; s < last; ++s) {
            for (int64_t j = 0; j < DV; ++j) {
                Vec v = Vec::loadu(vpage + s * D + j * L);
                for (int64_t g = 0; g < G; ++g) acc[g][j] = at::vec::fmadd(Vec(logit[g * S + s]), v, acc[g][j]);
            }
        }
        start += last - first;
    }
    for (int64_t g = 0; g < G; ++g) {
        m_out[g] = m[g]; l_out[g] = l[g];
        for (int64_t j = 0; j < DV; ++j) acc[g][j].store(acc_out + g * D + j * L);
    }
}

// The launch: threads = max_threads when the call has at least parallel_work multiply-adds,
// else 1 (an OpenMP fork/join costs more than small work); runs of `chunk` entries (0: whole
// pages, about items_per_thread runs per thread over all heads); the partials in `work`,
// sized by the caller for BH * max(1, ceil(items_per_thread * max_threads / BH)) runs.
extern "C" void kernel(const float* q, const float* kp, const float* vp, const int64_t* table,
                       const int64_t* lengths, const float* bias, float* work, float* out,
                       const int64_t BH, const int64_t M, const int64_t S, const int64_t has_bias,
                       const float scale, const int64_t max_threads, const int64_t items_per_thread,
                       const int64_t parallel_work, int64_t chunk) {
    const float* b = has_bias ? bias : nullptr;
    int64_t longest = 0, total = 0;
    for (int64_t bh = 0; bh < BH; ++bh) { longest = std::max(longest, lengths[bh]); total += lengths[bh]; }
    const int64_t threads = total * G * D >= parallel_work ? max_threads : 1;
    if (chunk <= 0) {
        const int64_t splits = threads > 1 ? std::max<int64_t>(1, (items_per_thread * threads + BH - 1) / BH) : 1;
        chunk = std::max(S, ((longest + splits - 1) / splits + S - 1) / S * S);
    }
    const int64_t chunks = std::max<int64_t>(1, (longest + chunk - 1) / chunk);
    float* part_m = work;
    float* part_l = part_m + BH * chunks * G;
    float* part_acc = part_l + BH * chunks * G;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if(threads > 1)
    for (int64_t item = 0; item < BH * chunks; ++item) {
        const int64_t bh = item / chunks, c = item % chunks;
        const int64_t lo = c * chunk, hi = std::min<int64_t>(lo + chunk, lengths[bh]);
        float* pm = part_m + item * G;
        float* pl = part_l + item * G;
        float* pa = part_acc + item * G * D;
        if (lo >= hi) {
            for (int64_t g = 0; g < G; ++g) { pm[g] = NEG_INF; pl[g] = 0.f; }
            for (int64_t i = 0; i < G * D; ++i) pa[i] = 0.f;
            continue;
        }
        std::vector<float> logit(G * S), dots(G * S * L);  // one page's logits, then its exp
        partial(q, scale, kp, vp, table, b, bh, M, S, lo, hi, logit.data(), dots.data(), pm, pl, pa);
    }
    // Combine the chunk partials of each head (rescaled to the head's max).
    for (int64_t bh = 0; bh < BH; ++bh) {
        for (int64_t g = 0; g < G; ++g) {
            float m_all = NEG_INF;
            for (int64_t c = 0; c < chunks; ++c) m_all = std::max(m_all, part_m[(bh * chunks + c) * G + g]);
            float* o = out + (bh * G + g) * D;
            for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
            if (m_all == NEG_INF) continue;  // an empty head gives zeros
            float den = 0.f;
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t p = (bh * chunks + c) * G + g;
                if (part_m[p] == NEG_INF) continue;
                const float w = std::exp(part_m[p] - m_all);
                den += w * part_l[p];
                for (int64_t i = 0; i < D; ++i) o[i] += w * part_acc[p * D + i];
            }
            for (int64_t i = 0; i < D; ++i) o[i] /= den;
        }
    }
}
