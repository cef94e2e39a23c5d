// One decode step of a layer whose step is an append and an attention, fused: the new key and value of every
// head written into the head's next slot (fp32 pages: copied; pages of int8 / int4 codes, keys and values per
// token: quantized by kvcompile/kernels/quantize.py's formula, bit for bit), then the pages' flash-decoding
// attention (paged_attention.cpp, whose text comes right before this one with its entry renamed
// `kvcompile_paged_attention_quant`). Built by kvcompile/kernels/append_step.py, where the contract is; the
// loader defines KVCOMPILE_G, _D, _FLOAT, _GK, _GV, and KVCOMPILE_APPEND_ONLY 1 for the build whose entry is the
// append alone (a batched decode step's, before its attention backend's call: kvcompile.store.pages.CppAppend).
#ifndef KVCOMPILE_TIERED  // (tiered_step.cpp's KIVI build appends to its float tier only, and flushes whole pages)
static_assert(!KCH, "the fused step appends entries one at a time: keys per token only (KIVI's per-channel "
                    "pages take whole pages, kvcompile.store.tiers)");
#endif

// One entry x (D floats) -> its codes (D * BITS / 8 bytes; int4: channel 2i in the low nibble of byte i),
// and the scale and zero point of each group of GRP channels. kvcompile.kernels.quantize's fp32 operations
// in its order: zero = min, scale = (max - min) / (2^BITS - 1) (a true division: the build's flags have no
// unsafe math and no contraction), 1 where that is 0, code = clamp(round((x - zero) / scale), 0, 2^BITS - 1)
// with round half to even (nearbyint in the default rounding mode, as torch.round).
template <int BITS, int64_t GRP>
static inline void quantize_entry(const float* x, uint8_t* codes, float* scale, float* zero) {
    constexpr float LEVELS = float((1 << BITS) - 1);
    uint8_t c[D];
    for (int64_t g = 0; g < D / GRP; ++g) {
        const float* xg = x + g * GRP;
        float lo = xg[0], hi = xg[0];
        for (int64_t i = 1; i < GRP; ++i) {
            lo = xg[i] < lo ? xg[i] : lo;
            hi = xg[i] > hi ? xg[i] : hi;
        }
        float s = (hi - lo) / LEVELS;
        if (s == 0.f) s = 1.f;
        scale[g] = s;
        zero[g] = lo;
        for (int64_t i = 0; i < GRP; ++i) {
            float r = std::nearbyint((xg[i] - lo) / s);
            r = r < 0.f ? 0.f : (r > LEVELS ? LEVELS : r);
            c[g * GRP + i] = static_cast<uint8_t>(r);
        }
    }
    if constexpr (BITS == 8) {
        for (int64_t i = 0; i < D; ++i) codes[i] = c[i];
    } else {
        for (int64_t i = 0; i < D / 2; ++i) codes[i] = static_cast<uint8_t>(c[2 * i] | (c[2 * i + 1] << 4));
    }
}

template <int BITS>
static void append_all(const float* k, const float* v, const int64_t* position, uint8_t* kc, float* ks, float* kz,
                       uint8_t* vc, float* vs, float* vz, float* sp, int64_t* pp, float* cp, const int64_t* table,
                       int64_t* lengths, int64_t B, int64_t H, int64_t M, int64_t S) {
    constexpr int64_t W = D * BITS / 8;
    for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t e = lengths[bh];
        const int64_t at = table[bh * M + e / S] * S + e % S;  // the head's next slot (LayerStore.append)
        if constexpr (BITS == 32) {  // fp32 pages: the entry as it is
            std::memcpy(kc + at * W, k + bh * D, W);
            std::memcpy(vc + at * W, v + bh * D, W);
        } else if constexpr (!KCH) {
            quantize_entry<BITS, GK>(k + bh * D, kc + at * W, ks + at * NGK, kz + at * NGK);
            quantize_entry<BITS, GV>(v + bh * D, vc + at * W, vs + at * NGV, vz + at * NGV);
        }
        sp[at] = 0.f;
        pp[at] = position[bh / H];
        cp[at] = 1.f;
        lengths[bh] = e + 1;
    }
}

// status[0]: 0 = every head's entry appended; 1 = some head's next entry has no page it owns (nothing changed).
static bool append_checked(const float* k, const float* v, const int64_t* position, uint8_t* kc, float* ks, float* kz,
                           uint8_t* vc, float* vs, float* vz, float* sp, int64_t* pp, float* cp, const int64_t* table,
                           int64_t* lengths, const int64_t* owned, int64_t B, int64_t H, int64_t M, int64_t S,
                           int64_t bits, int64_t* status) {
    status[0] = 0;
    for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t col = lengths[bh] / S;
        if (col >= owned[bh] || col >= M) { status[0] = 1; return false; }
    }
#if KVCOMPILE_FLOAT
    append_all<32>(k, v, position, kc, ks, kz, vc, vs, vz, sp, pp, cp, table, lengths, B, H, M, S);
#else
    if (bits == 8)
        append_all<8>(k, v, position, kc, ks, kz, vc, vs, vz, sp, pp, cp, table, lengths, B, H, M, S);
    else
        append_all<4>(k, v, position, kc, ks, kz, vc, vs, vz, sp, pp, cp, table, lengths, B, H, M, S);
#endif
    return true;
}

#if KVCOMPILE_APPEND_ONLY
// The append alone: every head's new entry into its next slot (step 1 above), status as append_checked's.
extern "C" void kernel(const float* k, const float* v, const int64_t* position, uint8_t* kc, float* ks, float* kz,
                       uint8_t* vc, float* vs, float* vz, float* sp, int64_t* pp, float* cp, const int64_t* table,
                       int64_t* lengths, const int64_t* owned, const int64_t B, const int64_t H, const int64_t M,
                       const int64_t S, const int64_t bits, int64_t* status) {
    append_checked(k, v, position, kc, ks, kz, vc, vs, vz, sp, pp, cp, table, lengths, owned, B, H, M, S, bits, status);
}
#else
// has_bias: the attention adds the merge rule's bias alpha * log w (alpha_p[0]) of each entry, written into
// `bias` (P * S floats) first (slots beside fp32 pages; the prompt's residual merge).
// status[0]: 0 = done; 1 = some head's next entry has no page it owns (nothing was changed: the engine makes
// room before the step, `LayerStore.make_room`, so this is an error). Threads, work items and the partials' workspace `work` as the
// paged kernel's launch (its parallel_work and items_per_thread; chunk 0: whole pages).
extern "C" void kernel(const float* q, const float* k, const float* v, const int64_t* position, uint8_t* kc,
                       float* ks, float* kz, uint8_t* vc, float* vs, float* vz, float* sp, int64_t* pp, float* cp,
                       const int64_t* table, int64_t* lengths, const int64_t* owned, float* work, float* out,
                       const int64_t B, const int64_t H, const int64_t M, const int64_t S, const float scale,
                       const int64_t max_threads, const int64_t items_per_thread, const int64_t parallel_work,
                       const int64_t bits, const int64_t has_bias, const double* alpha_p, float* bias, const int64_t P,
                       int64_t* status) {
    if (!append_checked(k, v, position, kc, ks, kz, vc, vs, vz, sp, pp, cp, table, lengths, owned, B, H, M, S, bits,
                        status))
        return;
    if (has_bias) {  // the merge rule's bias alpha * log w of every entry (-inf for w = 0), as MergeRule.bias
        const double alpha = alpha_p[0];
        for (int64_t i = 0; i < P * S; ++i)
            bias[i] = cp[i] > 0.f ? (float)(alpha * std::log((double)cp[i])) : -std::numeric_limits<float>::infinity();
    }
    kvcompile_paged_attention_quant(q, kc, ks, kz, vc, vs, vz, table, lengths, bias, work, out, out, B * H, M, S,
                                    has_bias, 0, scale, max_threads, items_per_thread, parallel_work, 0, bits);
}
#endif
