// Paged decode attention on the CPU over quantized pages (int8, int4): flash-decoding over each
// head's pages, the codes dequantized in registers. Built by kvcompile/kernels/paged_attention_quant.py
// through Inductor's C++ toolchain; the contract, the layout and the design are in that module's
// docstring, the quantizer in kvcompile/kernels/quantize.py.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

// The loader defines KVCOMPILE_G, KVCOMPILE_D, KVCOMPILE_GK, KVCOMPILE_GV and KVCOMPILE_AHEAD before
// this file: one build per (G, D, key group, value group), so every loop over the head dim unrolls
// and each group's scale and zero are broadcast once per entry; the bit width is a template argument.
constexpr int64_t G = KVCOMPILE_G, D = KVCOMPILE_D, AHEAD = KVCOMPILE_AHEAD;
constexpr int64_t GK = KVCOMPILE_GK;  // channels per key group; 0: keys per channel (over a page)
constexpr int64_t GV = KVCOMPILE_GV;  // channels per value group
constexpr bool KCH = GK == 0;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();
static_assert(D % L == 0, "head dim must be a multiple of the vector width");
static_assert(GK % L == 0 && GV % L == 0 && D % GV == 0 && (KCH || D % GK == 0),
              "groups divide the head dim and are multiples of the vector width");
constexpr int64_t DV = D / L;
constexpr int64_t NGK = KCH ? 1 : D / GK, NGV = D / GV;  // groups per entry
constexpr int64_t VPGK = KCH ? DV : GK / L, VPGV = GV / L;  // vectors per group
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
// Value vectors per block of P·V: G * JB accumulators stay in registers (16 vector registers with
// AVX2, 32 with AVX-512) while a page's entries stream through them.
constexpr int64_t ACC_REGS = L >= 16 ? 24 : 12;
constexpr int64_t pick_jb() {
    for (int64_t jb = DV; jb > 1; --jb)
        if (DV % jb == 0 && G * jb <= ACC_REGS) return jb;
    return 1;
}
constexpr int64_t JB = pick_jb();

// f(std::integral_constant<int64_t, i>) for i = 0 .. N-1, unrolled at compile time.
template <int64_t N, typename F>
static inline void unroll(F&& f) {
    [&]<int64_t... I>(std::integer_sequence<int64_t, I...>) {
        (f(std::integral_constant<int64_t, I>{}), ...);
    }(std::make_integer_sequence<int64_t, N>{});
}

static inline float hsum(const Vec& x) {
    return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

static inline float hmax(const Vec& x) {
    return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x);
}

// ----------------------------------------------------------------------------------- codes
// The codes of one entry (W = D * BITS / 8 bytes), vectors [J, J + N) as floats, channels in
// order. int4: channel 2i in the low nibble of byte i, channel 2i + 1 in its high nibble.

#if defined(CPU_CAPABILITY_AVX512)
static inline Vec widen(__m128i bytes) { return Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))); }
#elif defined(CPU_CAPABILITY_AVX2)
static inline Vec widen(__m128i bytes) { return Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))); }
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The codes of the packed bytes of x in channel order: nibbles of bytes 0-7 (lo), of bytes 8-15 (hi).
static inline __m128i nibbles_lo(__m128i x) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm_unpacklo_epi8(_mm_and_si128(x, mask), _mm_and_si128(_mm_srli_epi16(x, 4), mask));
}
static inline __m128i nibbles_hi(__m128i x) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm_unpackhi_epi8(_mm_and_si128(x, mask), _mm_and_si128(_mm_srli_epi16(x, 4), mask));
}
#endif

template <int BITS, int64_t J, int64_t N>
static inline void decode(const uint8_t* row, Vec* out) {
    static_assert(J + N <= DV);
    if constexpr (BITS == 8) {
        unroll<N>([&](auto i) {
            constexpr int64_t j = J + decltype(i)::value;
#if defined(CPU_CAPABILITY_AVX512)
            out[i] = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j * 16)));
#elif defined(CPU_CAPABILITY_AVX2)
            out[i] = widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j * 8)));
#else
            float f[L];
            for (int64_t c = 0; c < L; ++c) f[c] = float(row[j * L + c]);
            out[i] = Vec::loadu(f);
#endif
        });
    } else {
#if defined(CPU_CAPABILITY_AVX512)  // 16 bytes: 32 codes, two vectors
        unroll<N / 2>([&](auto i) {
            constexpr int64_t j = J + 2 * decltype(i)::value;
            const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j * 8));
            out[2 * i] = widen(nibbles_lo(x));
            out[2 * i + 1] = widen(nibbles_hi(x));
        });
        if constexpr (N % 2)
            out[N - 1] = widen(nibbles_lo(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (J + N - 1) * 8))));
#elif defined(CPU_CAPABILITY_AVX2)  // 8 bytes: 16 codes, two vectors
        unroll<N / 2>([&](auto i) {
            constexpr int64_t j = J + 2 * decltype(i)::value;
            const __m128i c = nibbles_lo(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j * 4)));
            out[2 * i] = widen(c);
            out[2 * i + 1] = widen(_mm_srli_si128(c, 8));
        });
        if constexpr (N % 2) {
            int32_t four;
            std::memcpy(&four, row + (J + N - 1) * 4, 4);
            out[N - 1] = widen(nibbles_lo(_mm_cvtsi32_si128(four)));
        }
#else
        for (int64_t i = 0; i < N; ++i) {
            float f[L];
            for (int64_t c0 = 0; c0 < L; ++c0) {
                const int64_t c = (J + i) * L + c0;
                f[c0] = float((row[c / 2] >> (4 * (c % 2))) & 0xF);
            }
            out[i] = Vec::loadu(f);
        }
#endif
    }
}

// x[i] = x[i] * scale + zero for vectors [J, J + N) of an entry whose groups (VPG vectors each)
// have scales sr and zeros zr: each group's pair broadcast once.
template <int64_t VPG, int64_t J, int64_t N>
static inline void dequant(Vec* x, const float* sr, const float* zr) {
    constexpr int64_t first = J / VPG, last = (J + N - 1) / VPG;
    unroll<last - first + 1>([&](auto gi) {
        constexpr int64_t grp = first + decltype(gi)::value;
        constexpr int64_t lo = std::max(J, grp * VPG) - J, hi = std::min(J + N, (grp + 1) * VPG) - J;
        const Vec sc(sr[grp]), zc(zr[grp]);
        unroll<hi - lo>([&](auto i) { x[lo + i] = at::vec::fmadd(x[lo + i], sc, zc); });
    });
}

// ------------------------------------------------------------------------- logit reductions

#if defined(CPU_CAPABILITY_AVX512)
// Lane i of the result = the sum of rows[16 i .. 16 i + 15], for 16 rows (a transpose-and-add tree).
static inline Vec lane_sums(const float* rows) {
    __m512 v[16], a[8], c[4];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(rows + 16 * i);
    for (int i = 0; i < 8; ++i)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return Vec(_mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1))));
}
constexpr bool TREE = true;
#elif defined(CPU_CAPABILITY_AVX2)
// Lane i of the result = the sum of rows[8 i .. 8 i + 7], for 8 rows: 6 horizontal adds, 2 lane
// permutes and an add instead of 8 horizontal sums.
static inline Vec lane_sums(const float* rows) {
    __m256 v[8];
    for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(rows + 8 * i);
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
    return Vec(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}
constexpr bool TREE = true;
#else
static inline Vec lane_sums(const float* rows) {
    float f[L];
    for (int64_t i = 0; i < L; ++i) f[i] = hsum(Vec::loadu(rows + i * L));
    return Vec::loadu(f);
}
constexpr bool TREE = false;
#endif

// --------------------------------------------------------------------------- online softmax
// Query head g over one page's logits row[0..S) (when `whole`, S a multiple of L and the entries
// outside [first, last) hold -inf: max, exp and sum run on vectors): row becomes exp(logit - m_new)
// (0 while nothing is finite), m and l are updated; returns the factor the accumulators take.
static inline float softmax_step(float* row, int64_t S, int64_t first, int64_t last, bool whole, float& m,
                                 float& l) {
    float page_max = NEG_INF;
    if (whole) {
        Vec mx(NEG_INF);
        for (int64_t s = 0; s < S; s += L) mx = at::vec::maximum(mx, Vec::loadu(row + s));
        page_max = hmax(mx);
    } else {
        for (int64_t s = first; s < last; ++s) page_max = std::max(page_max, row[s]);
    }
    const float m_new = std::max(m, page_max);
    if (m_new == NEG_INF) {  // nothing finite yet (bias -inf): no weight, the accumulators stay 0
        for (int64_t s = first; s < last; ++s) row[s] = 0.f;
        return 1.f;
    }
    const float rescale = std::exp(m - m_new);  // 0 when m = -inf, 1 when the max holds
    float sum = 0.f;
    if (whole) {
        Vec total(0.f);
        for (int64_t s = 0; s < S; s += L) {
            const Vec p = (Vec::loadu(row + s) - Vec(m_new)).exp();  // -inf lanes give 0
            p.store(row + s);
            total = total + p;
        }
        sum = hsum(total);
    } else {
        for (int64_t s = first; s < last; ++s) { row[s] = std::exp(row[s] - m_new); sum += row[s]; }
    }
    l = l * rescale + sum;
    m = m_new;
    return rescale;
}

// ------------------------------------------------------------------------------- one work item
// Entries [lo, hi) of head bh -> m (G), l (G), acc (G, D). BITS: 8 or 4 (keys and values). Keys
// per channel (KCH: scale, zero (P, D)) or per token ((P, S, NGK)); values per token ((P, S, NGV)).
// logit: G * S floats; dots: G * S * L floats; acc: the G * D accumulators between pages.
template <int BITS>
static void partial(const float* q, float scale, const uint8_t* kc, const float* ks, const float* kz,
                    const uint8_t* vc, const float* vs, const float* vz, const int64_t* table,
                    const float* bias, int64_t bh, int64_t M, int64_t S, int64_t lo, int64_t hi,
                    float* logit, float* dots, float* m_out, float* l_out, float* acc) {
    constexpr int64_t W = D * BITS / 8;  // code bytes per entry
    alignas(64) float qv[G][D];  // the scaled queries; per channel, times the page's key scales
    alignas(64) float qs[G][D];
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < DV; ++j) (Vec::loadu(q + (bh * G + g) * D + j * L) * Vec(scale)).store(qv[g] + j * L);
    float m[G], l[G], rescale[G], cz[G];
    for (int64_t g = 0; g < G; ++g) { m[g] = NEG_INF; l[g] = 0.f; cz[g] = 0.f; }
    for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
    const bool whole = S % L == 0;  // a page's logits fill whole vectors
    const bool tree = TREE && whole;
    for (int64_t start = lo; start < hi; ) {
        const int64_t page = table[bh * M + start / S];
        const int64_t first = start % S;
        const int64_t last = std::min<int64_t>(S, first + (hi - start));
        const uint8_t* kpage = kc + page * S * W;
        const uint8_t* vpage = vc + page * S * W;
        // Prefetch AHEAD pages on where the run's pages do not follow each other in the pool.
        if (start / S + AHEAD < (hi + S - 1) / S) {
            const int64_t next = table[bh * M + start / S + AHEAD];
            if (next != page + AHEAD) {
                for (int64_t line = 0; line < S * W; line += 64) {
                    __builtin_prefetch(kc + next * S * W + line);
                    __builtin_prefetch(vc + next * S * W + line);
                }
                const int64_t kfloats = KCH ? D : S * NGK;
                for (int64_t line = 0; line < kfloats; line += 16) {
                    __builtin_prefetch(ks + next * kfloats + line);
                    __builtin_prefetch(kz + next * kfloats + line);
                }
                for (int64_t line = 0; line < S * NGV; line += 16) {
                    __builtin_prefetch(vs + next * S * NGV + line);
                    __builtin_prefetch(vz + next * S * NGV + line);
                }
            }
        }
        // Keys per channel: q·k̂ = Σ_c (q_c scale_c) code_c + Σ_c q_c zero_c, both once per page.
        if constexpr (KCH) {
            for (int64_t g = 0; g < G; ++g) {
                Vec z(0.f);
                for (int64_t j = 0; j < DV; ++j) {
                    const Vec qj = Vec::loadu(qv[g] + j * L);
                    (qj * Vec::loadu(ks + page * D + j * L)).store(qs[g] + j * L);
                    z = at::vec::fmadd(qj, Vec::loadu(kz + page * D + j * L), z);
                }
                cz[g] = hsum(z);
            }
        }
        const float* qk = KCH ? qs[0] : qv[0];
        // q·k of each entry: a vector of partial sums per query head (two chains each).
        for (int64_t s = first; s < last; ++s) {
            Vec k[DV];
            decode<BITS, 0, DV>(kpage + s * W, k);
            if constexpr (!KCH) dequant<VPGK, 0, DV>(k, ks + (page * S + s) * NGK, kz + (page * S + s) * NGK);
            Vec d0[G], d1[G];
            unroll<G>([&](auto g) { d0[g] = Vec(0.f); d1[g] = Vec(0.f); });
            unroll<DV>([&](auto j) {
                unroll<G>([&](auto g) {
                    if constexpr (decltype(j)::value % 2 == 0)
                        d0[g] = at::vec::fmadd(Vec::loadu(qk + g * D + j * L), k[j], d0[g]);
                    else
                        d1[g] = at::vec::fmadd(Vec::loadu(qk + g * D + j * L), k[j], d1[g]);
                });
            });
            if (tree) {
                unroll<G>([&](auto g) { (d0[g] + d1[g]).store(dots + (g * S + s) * L); });
            } else {
                const float b = bias ? bias[page * S + s] : 0.f;
                unroll<G>([&](auto g) { logit[g * S + s] = hsum(d0[g] + d1[g]) + cz[g] + b; });
            }
        }
        if (tree) {  // the page's logits, L entries a vector; entries outside [first, last) -> -inf
            const Vec lane = Vec::arange(0.f, 1.f);
            for (int64_t s0 = 0; s0 < S; s0 += L) {
                const Vec t = lane + Vec(float(s0));
                const Vec valid = (t >= Vec(float(first))) & (t < Vec(float(last)));
                const Vec b = bias ? Vec::loadu(bias + page * S + s0) : Vec(0.f);
                for (int64_t g = 0; g < G; ++g) {
                    const Vec row = lane_sums(dots + (g * S + s0) * L) + Vec(cz[g]) + b;
                    Vec::blendv(Vec(NEG_INF), row, valid).store(logit + g * S + s0);
                }
            }
        } else if (whole) {
            for (int64_t g = 0; g < G; ++g) {
                for (int64_t s = 0; s < first; ++s) logit[g * S + s] = NEG_INF;
                for (int64_t s = last; s < S; ++s) logit[g * S + s] = NEG_INF;
            }
        }
        for (int64_t g = 0; g < G; ++g) rescale[g] = softmax_step(logit + g * S, S, first, last, whole, m[g], l[g]);
        // P·V̂ in blocks of JB value vectors: G * JB accumulators in registers over the page's
        // entries, each value vector dequantized once for the G query heads.
        unroll<DV / JB>([&](auto blk) {
            constexpr int64_t J = decltype(blk)::value * JB;
            Vec a[G][JB];
            unroll<G>([&](auto g) {
                unroll<JB>([&](auto i) { a[g][i] = Vec::loadu(acc + g * D + (J + i) * L) * Vec(rescale[g]); });
            });
            for (int64_t s = first; s < last; ++s) {
                Vec v[JB];
                decode<BITS, J, JB>(vpage + s * W, v);
                dequant<VPGV, J, JB>(v, vs + (page * S + s) * NGV, vz + (page * S + s) * NGV);
                unroll<G>([&](auto g) {
                    const Vec p(logit[g * S + s]);
                    unroll<JB>([&](auto i) { a[g][i] = at::vec::fmadd(p, v[i], a[g][i]); });
                });
            }
            unroll<G>([&](auto g) { unroll<JB>([&](auto i) { a[g][i].store(acc + g * D + (J + i) * L); }); });
        });
        start += last - first;
    }
    for (int64_t g = 0; g < G; ++g) { m_out[g] = m[g]; l_out[g] = l[g]; }
}

template <int BITS>
static void run_items(const float* q, const uint8_t* kc, const float* ks, const float* kz, const uint8_t* vc,
                      const float* vs, const float* vz, const int64_t* table, const int64_t* lengths,
                      const float* bias, float* part_m, float* part_l, float* part_acc, int64_t BH,
                      int64_t M, int64_t S, float scale, int64_t threads, int64_t chunk, int64_t chunks) {
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
        partial<BITS>(q, scale, kc, ks, kz, vc, vs, vz, table, bias, bh, M, S, lo, hi, logit.data(), dots.data(),
                      pm, pl, pa);
    }
}

// The launch: bits 8 or 4. Threads = max_threads when the call has at least parallel_work
// multiply-adds, else 1; runs of `chunk` entries (0: whole pages, about items_per_thread runs per
// thread over all heads); the partials in `work`, sized by the caller for
// BH * max(1, ceil(items_per_thread * max_threads / BH)) runs (or the runs of the given chunk).
// lse (BH * G; written when has_lse): log Σ exp(logit) per query head, -inf for an empty head.
extern "C" void kernel(const float* q, const uint8_t* kc, const float* ks, const float* kz, const uint8_t* vc,
                       const float* vs, const float* vz, const int64_t* table, const int64_t* lengths,
                       const float* bias, float* work, float* out, float* lse, const int64_t BH,
                       const int64_t M, const int64_t S, const int64_t has_bias, const int64_t has_lse,
                       const float scale, const int64_t max_threads, const int64_t items_per_thread,
                       const int64_t parallel_work, int64_t chunk, const int64_t bits) {
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
    if (bits == 8)
        run_items<8>(q, kc, ks, kz, vc, vs, vz, table, lengths, b, part_m, part_l, part_acc, BH, M, S, scale,
                     threads, chunk, chunks);
    else
        run_items<4>(q, kc, ks, kz, vc, vs, vz, table, lengths, b, part_m, part_l, part_acc, BH, M, S, scale,
                     threads, chunk, chunks);
    // Combine the chunk partials of each head (rescaled to the head's max).
    for (int64_t bh = 0; bh < BH; ++bh) {
        for (int64_t g = 0; g < G; ++g) {
            float m_all = NEG_INF;
            for (int64_t c = 0; c < chunks; ++c) m_all = std::max(m_all, part_m[(bh * chunks + c) * G + g]);
            float* o = out + (bh * G + g) * D;
            for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
            if (has_lse) lse[bh * G + g] = NEG_INF;
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
            if (has_lse) lse[bh * G + g] = m_all + std::log(den);
        }
    }
}
