// Paged decode attention on the CPU: flash-decoding over each head's pages, one kernel for pages of fp32 keys
// and values and for pages of int8 / int4 codes: one entry, launch, split into work items, online softmax,
// logit tree and combination of the partials; a work item's per-page loops take their load's register
// blocking (`partial_fp32`: a plain load; `partial<BITS>`: the codes dequantized in registers, `decode`). Built by
// kvcompile/kernels/paged_attention_cpp.py through Inductor's C++ toolchain; the contract, the layout and
// the design are in kvcompile/kernels/paged_attention.py and paged_attention_quant.py, the quantizer (KIVI /
// MiKV's asymmetric round-to-nearest) in kvcompile/kernels/quantize.py.
#if defined(KVCOMPILE_PORTABLE) && KVCOMPILE_PORTABLE  // tests: the code paths of CPUs without AVX2 (ARM:
#undef CPU_CAPABILITY_AVX2                                  // at::vec and plain loops) on an x86 machine
#undef CPU_CAPABILITY_AVX512
#endif
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// The loader defines KVCOMPILE_G, KVCOMPILE_D, KVCOMPILE_FLOAT, KVCOMPILE_GK, KVCOMPILE_GV and
// KVCOMPILE_AHEAD before this file: one build per (G, D, float or codes, key group, value group), so every
// loop over the head dim unrolls and each group's scale and zero are read once per entry; the bit width is
// a template argument (32: fp32 pages, in every build; 8 and 4: codes, both in a build of codes).
#ifndef KVCOMPILE_FLOAT
#define KVCOMPILE_FLOAT 0
#endif
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

// Vector registers: 16 with AVX2, 32 with AVX-512; the loops below are sized to fit them.
#ifndef KVCOMPILE_REGS
#define KVCOMPILE_REGS (L >= 16 ? 32 : 16)
#endif
constexpr int64_t REGS = KVCOMPILE_REGS;
// Registers a loop holds besides its accumulators: int4 decoding keeps one constant (the shifts).
template <int BITS>
constexpr int64_t decode_regs() { return BITS == 4 ? 1 : 0; }
// P·V in blocks of JB value vectors: G * JB accumulators and a value vector with its scale and zero
// stay in registers while a page's entries stream through (the weights p are FMA memory operands).
template <int BITS>
constexpr int64_t pick_jb() {
    for (int64_t jb = DV; jb > 1; --jb)
        if (DV % jb == 0 && G * jb + 3 + decode_regs<BITS>() <= REGS) return jb;
    return 1;
}
// Keys per token in one group (GK = D): q·k̂ = scale · (q·code) + zero · Σ_c q_c, applied to a page's
// logits, L entries a vector, after the sums. Keys in several groups are dequantized vector by vector.
constexpr bool KFACT = !KCH && NGK == 1;
constexpr bool KDEQ = !KCH && NGK > 1;
// q·k: KE entries a step share each query vector load, with KC chains of partial sums per (entry,
// query head), so that KE * KC * G independent FMA chains hide the FMA latency within the registers.
constexpr int64_t KE = 2 * G + 4 <= REGS ? 2 : 1;
template <int BITS>
constexpr int64_t pick_kc() {
    int64_t kc = 1;
    while (kc < 4 && DV % (2 * kc) == 0 &&
           KE * 2 * kc * G + KE + 1 + (KDEQ ? 2 * KE : 0) + decode_regs<BITS>() <= REGS)
        kc *= 2;
    return kc;
}

static inline float hsum(const Vec& x) {
    return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

static inline float hmax(const Vec& x) {
    return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x);
}

// ----------------------------------------------------------------------------------- codes
// Vector J of an entry's codes as floats, channels in order (J is a constant once the loops around
// it unroll). int8: a widening load and a convert. int4 (channel 2i in the low nibble of byte i,
// 2i + 1 in its high nibble): little-endian dword i holds codes 8i .. 8i + 7, code 8i + c at bits
// 4c .. 4c + 3, so a broadcast dword shifted left by 28 - 4c in lane c, then right by 28, gives 8
// codes (one constant register: the shifts).
template <int BITS>
static inline Vec decode(const uint8_t* row, int64_t J) {
    if constexpr (BITS == 8) {
#if defined(CPU_CAPABILITY_AVX512)
        return Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + J * 16)))));
#elif defined(CPU_CAPABILITY_AVX2)
        return Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + J * 8)))));
#else
        float f[L];
        for (int64_t c = 0; c < L; ++c) f[c] = float(row[J * L + c]);
        return Vec::loadu(f);
#endif
    } else {
#if defined(CPU_CAPABILITY_AVX512)  // 8 bytes: dword 0 to lanes 0-7, dword 1 to lanes 8-15
        const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        const __m512i shifts = _mm512_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
        const __m512i x = _mm512_permutexvar_epi32(
            spread, _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + J * 8))));
        return Vec(_mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_sllv_epi32(x, shifts), 28)));
#elif defined(CPU_CAPABILITY_AVX2)  // 4 bytes: the dword broadcast to 8 lanes; lane c: << (28 - 4c), >> 28
        const __m256i shifts = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
        int32_t word;
        std::memcpy(&word, row + J * 4, 4);
        return Vec(_mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(word), shifts), 28)));
#else
        float f[L];
        for (int64_t c0 = 0; c0 < L; ++c0) {
            const int64_t c = J * L + c0;
            f[c0] = float((row[c / 2] >> (4 * (c % 2))) & 0xF);
        }
        return Vec::loadu(f);
#endif
    }
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

// ------------------------------------------------------------------------ a work item's pages
// The page AHEAD pages on in a run of entries [start, hi) when it does not follow `page` in the pool (which defeats
// the hardware prefetcher), else -1; row: the head's block table.
static inline int64_t out_of_order(const int64_t* row, int64_t S, int64_t start, int64_t hi, int64_t page) {
    if (start / S + AHEAD >= (hi + S - 1) / S) return -1;
    const int64_t next = row[start / S + AHEAD];
    return next != page + AHEAD ? next : -1;
}

// Start loading `bytes` of a and of b, a cache line of each in turn.
static inline void prefetch2(const void* a, const void* b, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) {
        __builtin_prefetch(static_cast<const char*>(a) + line);
        __builtin_prefetch(static_cast<const char*>(b) + line);
    }
}

// Page `page`'s logits (G, S) from its dot vectors dots (G, S, L) by the tree, L entries a vector: the lane
// sums, `adjust(row, g, s0)` (what the keys' load leaves to add), then its bias; entries outside [first, last)
// -> -inf.
template <typename Adjust>
static inline void tree_logits(const float* dots, float* logit, int64_t S, int64_t first, int64_t last,
                               const float* bias, int64_t page, Adjust adjust) {
    const Vec lane = Vec::arange(0.f, 1.f);
    for (int64_t s0 = 0; s0 < S; s0 += L) {
        const Vec t = lane + Vec(float(s0));
        const Vec valid = (t >= Vec(float(first))) & (t < Vec(float(last)));
        const Vec b = bias ? Vec::loadu(bias + page * S + s0) : Vec(0.f);
        for (int64_t g = 0; g < G; ++g)
            Vec::blendv(Vec(NEG_INF), adjust(lane_sums(dots + (g * S + s0) * L), g, s0) + b, valid)
                .store(logit + g * S + s0);
    }
}

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
    const float rescale = m_new == m ? 1.f : std::exp(m - m_new);  // 0 when m = -inf
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

// ----------------------------------------------------------------------------------- q·k
// The dot products of the G query heads qk (G, D) with NE consecutive entries' keys (codes from
// krow, W bytes apart; per-token scales and zeros from sr, zr, NGK apart when KDEQ), as vectors of
// partial sums out[e][g] (their lanes sum to q·k̂, or to q·code for KCH and KFACT).
template <int BITS, int64_t NE>
static inline void qk_dots(const uint8_t* krow, const float* qk, const float* sr, const float* zr, Vec (&out)[NE][G]) {
    constexpr int64_t W = D * BITS / 8, KC = pick_kc<BITS>();
    Vec d[NE][KC][G];
#pragma GCC unroll 64
    for (int64_t e = 0; e < NE; ++e)
#pragma GCC unroll 64
        for (int64_t c = 0; c < KC; ++c)
#pragma GCC unroll 64
            for (int64_t g = 0; g < G; ++g) d[e][c][g] = Vec(0.f);
#pragma GCC unroll 64
    for (int64_t j = 0; j < DV; ++j) {
        Vec k[NE];
#pragma GCC unroll 64
        for (int64_t e = 0; e < NE; ++e) {
            k[e] = decode<BITS>(krow + e * W, j);
            if constexpr (KDEQ) k[e] = at::vec::fmadd(k[e], Vec(sr[e * NGK + j / VPGK]), Vec(zr[e * NGK + j / VPGK]));
        }
#pragma GCC unroll 64
        for (int64_t g = 0; g < G; ++g) {
            const Vec qj = Vec::loadu(qk + g * D + j * L);
#pragma GCC unroll 64
            for (int64_t e = 0; e < NE; ++e) d[e][j % KC][g] = at::vec::fmadd(qj, k[e], d[e][j % KC][g]);
        }
    }
#pragma GCC unroll 64
    for (int64_t e = 0; e < NE; ++e)
#pragma GCC unroll 64
        for (int64_t g = 0; g < G; ++g) {
            Vec dot = d[e][0][g];
#pragma GCC unroll 64
            for (int64_t c = 1; c < KC; ++c) dot = dot + d[e][c][g];
            out[e][g] = dot;
        }
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
    constexpr int64_t JB = pick_jb<BITS>();
    alignas(64) float qv[G * D];  // the scaled queries
    alignas(64) float qs[G * D];  // keys per channel: the scaled queries times the page's key scales
    float m[G], l[G], rescale[G], cz[G], qsum[G];  // qsum: Σ_c q_c (scaled), for KFACT
    for (int64_t g = 0; g < G; ++g) {
        Vec t(0.f);
        for (int64_t j = 0; j < DV; ++j) {
            const Vec x = Vec::loadu(q + (bh * G + g) * D + j * L) * Vec(scale);
            x.store(qv + g * D + j * L);
            t = t + x;
        }
        qsum[g] = hsum(t);
        m[g] = NEG_INF; l[g] = 0.f; cz[g] = 0.f;
    }
    for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
    const float* qk = KCH ? qs : qv;
    const bool whole = S % L == 0;  // a page's logits fill whole vectors
    const bool tree = TREE && whole;
    for (int64_t start = lo; start < hi; ) {
        const int64_t page = table[bh * M + start / S];
        const int64_t first = start % S;
        const int64_t last = std::min<int64_t>(S, first + (hi - start));
        const uint8_t* kpage = kc + page * S * W;
        const uint8_t* vpage = vc + page * S * W;
        // Start the loads of the page AHEAD pages on where the pages up to it do not lie in order.
        if (const int64_t next = out_of_order(table + bh * M, S, start, hi, page); next >= 0) {
            const int64_t kfloats = KCH ? D : S * NGK;
            prefetch2(kc + next * S * W, vc + next * S * W, S * W);
            prefetch2(ks + next * kfloats, kz + next * kfloats, kfloats * sizeof(float));
            prefetch2(vs + next * S * NGV, vz + next * S * NGV, S * NGV * sizeof(float));
        }
        // Keys per channel: q·k̂ = Σ_c (q_c scale_c) code_c + Σ_c q_c zero_c, both once per page.
        if constexpr (KCH) {
            for (int64_t g = 0; g < G; ++g) {
                Vec z(0.f);
#pragma GCC unroll 64
                for (int64_t j = 0; j < DV; ++j) {
                    const Vec qj = Vec::loadu(qv + g * D + j * L);
                    (qj * Vec::loadu(ks + page * D + j * L)).store(qs + g * D + j * L);
                    z = at::vec::fmadd(qj, Vec::loadu(kz + page * D + j * L), z);
                }
                cz[g] = hsum(z);
            }
        }
        // q·k of each entry, KE at a time: a vector of partial sums per query head, into `dots`
        // (summed to logits by the tree below) or summed here.
        const float* ksp = KCH ? ks : ks + page * S * NGK;
        const float* kzp = KCH ? kz : kz + page * S * NGK;
        for (int64_t s = first; s < last; ) {
            Vec out[KE][G];
            int64_t n = KE;
            if (s + KE <= last) {
                qk_dots<BITS, KE>(kpage + s * W, qk, ksp + s * NGK, kzp + s * NGK, out);
            } else {
                Vec one[1][G];
                qk_dots<BITS, 1>(kpage + s * W, qk, ksp + s * NGK, kzp + s * NGK, one);
                for (int64_t g = 0; g < G; ++g) out[0][g] = one[0][g];
                n = 1;
            }
            for (int64_t e = 0; e < n; ++e)
                for (int64_t g = 0; g < G; ++g) {
                    if (tree) {
                        out[e][g].store(dots + (g * S + s + e) * L);
                    } else {
                        float x = hsum(out[e][g]);
                        if constexpr (KFACT) x = x * ksp[s + e] + kzp[s + e] * qsum[g];
                        logit[g * S + s + e] = x + cz[g] + (bias ? bias[page * S + s + e] : 0.f);
                    }
                }
            s += n;
        }
        if (tree) {
            tree_logits(dots, logit, S, first, last, bias, page, [&](Vec row, int64_t g, int64_t s0) {
                if constexpr (KFACT)
                    row = at::vec::fmadd(row, Vec::loadu(ksp + s0), Vec::loadu(kzp + s0) * Vec(qsum[g]));
                return row + Vec(cz[g]);
            });
        } else if (whole) {
            for (int64_t g = 0; g < G; ++g) {
                for (int64_t s = 0; s < first; ++s) logit[g * S + s] = NEG_INF;
                for (int64_t s = last; s < S; ++s) logit[g * S + s] = NEG_INF;
            }
        }
        for (int64_t g = 0; g < G; ++g) rescale[g] = softmax_step(logit + g * S, S, first, last, whole, m[g], l[g]);
        // p of each (query head, entry) as a whole vector in `dots` (free once the logits are read):
        // the FMAs below take it from memory, a load instead of a broadcast per use.
        for (int64_t g = 0; g < G; ++g)
            for (int64_t s = first; s < last; ++s) Vec(logit[g * S + s]).store(dots + (g * S + s) * L);
        // P·V̂ in blocks of JB value vectors: G * JB accumulators in registers over the page's
        // entries, each value vector dequantized once for the G query heads.
        const float* vsp = vs + page * S * NGV;
        const float* vzp = vz + page * S * NGV;
#pragma GCC unroll 64
        for (int64_t J = 0; J < DV; J += JB) {
            Vec a[G][JB];
#pragma GCC unroll 64
            for (int64_t g = 0; g < G; ++g)
#pragma GCC unroll 64
                for (int64_t i = 0; i < JB; ++i) a[g][i] = Vec::loadu(acc + g * D + (J + i) * L) * Vec(rescale[g]);
            for (int64_t s = first; s < last; ++s) {
#pragma GCC unroll 64
                for (int64_t i = 0; i < JB; ++i) {
                    const int64_t grp = (J + i) / VPGV;
                    const Vec v = at::vec::fmadd(decode<BITS>(vpage + s * W, J + i), Vec(vsp[s * NGV + grp]),
                                                 Vec(vzp[s * NGV + grp]));
#pragma GCC unroll 64
                    for (int64_t g = 0; g < G; ++g)
                        a[g][i] = at::vec::fmadd(Vec::loadu(dots + (g * S + s) * L), v, a[g][i]);
                }
            }
#pragma GCC unroll 64
            for (int64_t g = 0; g < G; ++g)
#pragma GCC unroll 64
                for (int64_t i = 0; i < JB; ++i) a[g][i].store(acc + g * D + (J + i) * L);
        }
        start += last - first;
    }
    for (int64_t g = 0; g < G; ++g) { m_out[g] = m[g]; l_out[g] = l[g]; }
}

// The same work item over fp32 pages (BITS 32), with its own register blocking: a plain load leaves the
// registers the codes' decoding needs free, so the G * DV scaled query vectors stay in registers over the
// item and the G * DV accumulators over each page, each logit broadcast into the P·V FMAs (measured about
// 1.3-2x faster on fp32 pages than the blocked loops above, which pay off where a vector is decoded).
static void partial_fp32(const float* q, float scale, const float* kp, const float* vp, const int64_t* table,
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
    const bool whole = S % L == 0;
    const bool tree = TREE && whole;
    for (int64_t start = lo; start < hi; ) {
        const int64_t page = table[bh * M + start / S];
        const int64_t first = start % S;
        const int64_t last = std::min<int64_t>(S, first + (hi - start));
        const float* kpage = kp + page * S * D;
        const float* vpage = vp + page * S * D;
        if (const int64_t next = out_of_order(table + bh * M, S, start, hi, page); next >= 0)
            prefetch2(kp + next * S * D, vp + next * S * D, S * D * sizeof(float));
        for (int64_t s = first; s < last; ++s) {  // q·k of each entry as a vector of partial sums
            Vec dot[G];
            for (int64_t g = 0; g < G; ++g) dot[g] = Vec(0.f);
            for (int64_t j = 0; j < DV; ++j) {
                const Vec k = Vec::loadu(kpage + s * D + j * L);
                for (int64_t g = 0; g < G; ++g) dot[g] = at::vec::fmadd(qv[g][j], k, dot[g]);
            }
            for (int64_t g = 0; g < G; ++g) {
                if (tree) dot[g].store(dots + (g * S + s) * L);
                else logit[g * S + s] = hsum(dot[g]) + (bias ? bias[page * S + s] : 0.f);
            }
        }
        if (tree) tree_logits(dots, logit, S, first, last, bias, page, [](Vec row, int64_t, int64_t) { return row; });
        for (int64_t g = 0; g < G; ++g) {
            const Vec r(softmax_step(logit + g * S, S, first, last, tree, m[g], l[g]));
            for (int64_t j = 0; j < DV; ++j) acc[g][j] = acc[g][j] * r;
        }
        for (int64_t s = first; s < last; ++s)
            for (int64_t j = 0; j < DV; ++j) {
                const Vec v = Vec::loadu(vpage + s * D + j * L);
                for (int64_t g = 0; g < G; ++g) acc[g][j] = at::vec::fmadd(Vec(logit[g * S + s]), v, acc[g][j]);
            }
        start += last - first;
    }
    for (int64_t g = 0; g < G; ++g) {
        m_out[g] = m[g]; l_out[g] = l[g];
        for (int64_t j = 0; j < DV; ++j) acc[g][j].store(acc_out + g * D + j * L);
    }
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
        if constexpr (BITS == 32)
            partial_fp32(q, scale, reinterpret_cast<const float*>(kc), reinterpret_cast<const float*>(vc), table,
                         bias, bh, M, S, lo, hi, logit.data(), dots.data(), pm, pl, pa);
        else
            partial<BITS>(q, scale, kc, ks, kz, vc, vs, vz, table, bias, bh, M, S, lo, hi, logit.data(),
                          dots.data(), pm, pl, pa);
    }
}

// The launch: bits 32 (fp32 pages; scales and zeros unused), or 8 or 4 (a build of codes). Threads =
// max_threads when the call has at least parallel_work multiply-adds, else 1; runs of `chunk` entries (0: whole pages, about items_per_thread runs per
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
    if (bits == 32)
        run_items<32>(q, kc, ks, kz, vc, vs, vz, table, lengths, b, part_m, part_l, part_acc, BH, M, S, scale,
                      threads, chunk, chunks);
#if !KVCOMPILE_FLOAT  // (a build of fp32 pages has no codes' loops)
    else if (bits == 8)
        run_items<8>(q, kc, ks, kz, vc, vs, vz, table, lengths, b, part_m, part_l, part_acc, BH, M, S, scale,
                     threads, chunk, chunks);
    else
        run_items<4>(q, kc, ks, kz, vc, vs, vz, table, lengths, b, part_m, part_l, part_acc, BH, M, S, scale,
                     threads, chunk, chunks);
#endif
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
