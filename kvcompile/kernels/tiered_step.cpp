// One decode step of a layer whose heads hold entries in two tiers (kvcompile.store.tiers.TieredStore: float
// pages in the model's dtype, `high`, and int8 / int4 codes per token, `low`), fused: the new key and value
// appended to the appending tier (high: copied; low: quantized; both as append_step.cpp's append_all), then the
// attention over the high tier (with the merge rule's bias alpha * log w on its slots) and over the codes, each
// by the paged kernel of paged_attention.cpp (fp32 pages, codes) with its log-sum-exp, combined by them. Built
// by kvcompile/kernels/tiered_step.py after paged_attention.cpp and append_step.cpp (both entries renamed).

// KIVI (keys per channel, KCH: the paged kernel built with GK 0): after the append to the float tier, every head
// whose float tier holds RESIDUAL + LS entries moves its oldest LS (its first LS / HS pages: the float tier is
// filled from a page start and flushed a page run at a time) into the codes' page at its column llengths / LS,
// keys per channel over the LS entries, values per entry (GV channels a scale), each by quantize.py's formula
// in its fp32 order; the float tier's first pages then go to the end of the run it owns and its count drops by
// LS (ChannelCodeStore.flush and LayerStore.rotate_out, which write the next page of every head, used or not;
// here only a flushing head's). scratch: HM int64 (the rotated row).
template <int BITS>
static void flush_channel(const float* hk, const float* hv, const float* hs, const int64_t* hp, const float* hc,
                          int64_t* htable, int64_t* hlengths, const int64_t* howned, int64_t HM, int64_t HS,
                          uint8_t* kc, float* ks, float* kz, uint8_t* vc, float* vs, float* vz, float* ls,
                          int64_t* lp, float* lc, const int64_t* ltable, int64_t* llengths, int64_t LM, int64_t LS,
                          int64_t BH, int64_t residual, int64_t* scratch) {
    constexpr float LEVELS = float((1 << BITS) - 1);
    constexpr int64_t W = D * BITS / 8;
    const int64_t cols = LS / HS;
    for (int64_t bh = 0; bh < BH; ++bh) {
        if (hlengths[bh] < residual + LS) continue;
        const int64_t* row = htable + bh * HM;
        const int64_t page = ltable[bh * LM + llengths[bh] / LS];
        auto src = [&](int64_t e) { return row[e / HS] * HS + e % HS; };
        for (int64_t c = 0; c < D; ++c) {  // keys: channel c over the LS entries
            float lo = hk[src(0) * D + c], hi = lo;
            for (int64_t e = 1; e < LS; ++e) {
                const float x = hk[src(e) * D + c];
                lo = x < lo ? x : lo;
                hi = x > hi ? x : hi;
            }
            float s = (hi - lo) / LEVELS;
            if (s == 0.f) s = 1.f;
            ks[page * D + c] = s;
            kz[page * D + c] = lo;
            for (int64_t e = 0; e < LS; ++e) {
                float r = std::nearbyint((hk[src(e) * D + c] - lo) / s);
                r = r < 0.f ? 0.f : (r > LEVELS ? LEVELS : r);
                uint8_t* out = kc + (page * LS + e) * W;
                if constexpr (BITS == 8) {
                    out[c] = static_cast<uint8_t>(r);
                } else if (c % 2 == 0) {
                    out[c / 2] = static_cast<uint8_t>(r);
                } else {
                    out[c / 2] = static_cast<uint8_t>(out[c / 2] | (static_cast<uint8_t>(r) << 4));
                }
            }
        }
        for (int64_t e = 0; e < LS; ++e) {  // values per entry; scores, positions and counts as they are
            const int64_t at = page * LS + e, from = src(e);
            quantize_entry<BITS, GV>(hv + from * D, vc + at * W, vs + at * NGV, vz + at * NGV);
            ls[at] = hs[from];
            lp[at] = hp[from];
            lc[at] = hc[from];
        }
        llengths[bh] += LS;
        const int64_t owned = howned[bh] > 0 ? howned[bh] : 1;
        for (int64_t j = 0; j < HM; ++j) scratch[j] = j < howned[bh] ? row[(j + cols) % owned] : row[j];
        std::memcpy(htable + bh * HM, scratch, HM * sizeof(int64_t));
        hlengths[bh] -= LS;
    }
}

// status[0]: 0 = done; 1 = some head's next entry has no page it owns in the appending tier (nothing changed).
// append_low: the new entry goes to the codes (a storage part that keeps every token as codes, its merge
// slots alone in floats), else to the float tier (mixed precision: generated tokens in the model's dtype).
extern "C" void kernel(const float* q, const float* k, const float* v, const int64_t* position,
                       float* hk, float* hv, float* hs, int64_t* hp, float* hc, int64_t* htable,
                       int64_t* hlengths, const int64_t* howned, const int64_t HM, const int64_t HS,
                       uint8_t* kc, float* ks, float* kz, uint8_t* vc, float* vs, float* vz, float* ls, int64_t* lp,
                       float* lc, const int64_t* ltable, int64_t* llengths, const int64_t* lowned, const int64_t LM,
                       const int64_t LS, float* work, float* out_low, float* lse_low, float* out_high,
                       float* lse_high, float* bias, const int64_t HP, float* out, const int64_t B,
                       const int64_t H, const float scale, const int64_t has_bias, const double* alpha_p,
                       const int64_t append_low, const int64_t max_threads, const int64_t items_per_thread,
                       const int64_t parallel_work, const int64_t bits, const int64_t residual,
                       int64_t* scratch, int64_t* status) {
    status[0] = 0;
    for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t col = append_low ? llengths[bh] / LS : hlengths[bh] / HS;
        if (col >= (append_low ? lowned[bh] : howned[bh]) || col >= (append_low ? LM : HM)) { status[0] = 1; return; }
        if (KCH && (llengths[bh] / LS >= lowned[bh] || llengths[bh] / LS >= LM)) { status[0] = 2; return; }
    }
    if (KCH) {  // KIVI: the entry to the float tier, then the flush of every head whose float tier is full
        append_all<32>(k, v, position, reinterpret_cast<uint8_t*>(hk), nullptr, nullptr, reinterpret_cast<uint8_t*>(hv),
                       nullptr, nullptr, hs, hp, hc, htable, hlengths, B, H, HM, HS);
        if (bits == 8)
            flush_channel<8>(hk, hv, hs, hp, hc, htable, hlengths, howned, HM, HS, kc, ks, kz, vc, vs, vz, ls, lp, lc,
                             ltable, llengths, LM, LS, B * H, residual, scratch);
        else
            flush_channel<4>(hk, hv, hs, hp, hc, htable, hlengths, howned, HM, HS, kc, ks, kz, vc, vs, vz, ls, lp, lc,
                             ltable, llengths, LM, LS, B * H, residual, scratch);
    } else if (append_low) {
        if (bits == 8)
            append_all<8>(k, v, position, kc, ks, kz, vc, vs, vz, ls, lp, lc, ltable, llengths, B, H, LM, LS);
        else
            append_all<4>(k, v, position, kc, ks, kz, vc, vs, vz, ls, lp, lc, ltable, llengths, B, H, LM, LS);
    } else {  // LayerStore.append of float pages
        append_all<32>(k, v, position, reinterpret_cast<uint8_t*>(hk), nullptr, nullptr, reinterpret_cast<uint8_t*>(hv),
                       nullptr, nullptr, hs, hp, hc, htable, hlengths, B, H, HM, HS);
    }
    kvcompile_paged_attention_quant(q, kc, ks, kz, vc, vs, vz, ltable, llengths, nullptr, work, out_low, lse_low,
                                    B * H, LM, LS, 0, 1, scale, max_threads, items_per_thread, parallel_work, 0, bits);
    if (has_bias) {  // the merge rule's bias alpha * log w of the float tier's entries (-inf for w = 0)
        const double alpha = alpha_p[0];
        for (int64_t i = 0; i < HP * HS; ++i) bias[i] = hc[i] > 0.f ? (float)(alpha * std::log((double)hc[i])) : NEG_INF;
    }
    kvcompile_paged_attention_quant(q, reinterpret_cast<const uint8_t*>(hk), nullptr, nullptr,
                                    reinterpret_cast<const uint8_t*>(hv), nullptr, nullptr, htable, hlengths, bias,
                                    work, out_high, lse_high, B * H, HM, HS, has_bias, 1, scale, max_threads,
                                    items_per_thread, parallel_work, 0, 32);
    for (int64_t bh = 0; bh < B * H; ++bh) {
        for (int64_t g = 0; g < G; ++g) {  // merge_partials: the attention over the union of the two tiers
            const int64_t r = bh * G + g;
            const float a = lse_high[r], b = lse_low[r];
            float top = a > b ? a : b;
            if (top == NEG_INF) top = 0.f;
            const float wa = std::exp(a - top), wb = std::exp(b - top), den = wa + wb;
            const float inv_den = den > 0.f ? den : 1.f;
            for (int64_t j = 0; j < D; ++j) out[r * D + j] = (wa * out_high[r * D + j] + wb * out_low[r * D + j]) / inv_den;
        }
    }
}
