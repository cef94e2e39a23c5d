// One decode step of a layer whose heads hold entries in two tiers (kvcompile.store.tiers.TieredStore: float
// pages in the model's dtype, `high`, and int8 / int4 codes per token, `low`), fused: the new key and value
// appended to the appending tier (high: copied; low: quantized as append_step.cpp does), then the attention over
// the high tier (with the merge rule's bias alpha * log w on its slots) and over the codes (the paged kernel of
// paged_attention_quant.cpp, with its log-sum-exp), combined by their log-sum-exp. Built by
// kvcompile/kernels/tiered_step.py after paged_attention_quant.cpp and append_step.cpp (both entries renamed).

static inline float dot_row(const float* a, const float* b) {
    Vec acc(0.f);
    for (int64_t j = 0; j < D; j += L) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
    return hsum(acc);
}

// The high tier's attention of head bh's G query heads over its n float entries: the log-sum-exp of each
// query head's logits and its normalised output (-inf and zeros for an empty head or nothing finite).
static void high_attention(const float* q, float scale, const float* kp, const float* vp, const float* cp,
                           const int64_t* table, int64_t M, int64_t S, int64_t bh, int64_t n, int64_t has_bias,
                           double alpha, std::vector<float>& p, float* lse, float* out) {
    p.resize(n > 0 ? n : 1);
    for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + (bh * G + g) * D;
        float* o = out + g * D;
        float mx = NEG_INF;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t at = table[bh * M + i / S] * S + i % S;
            float l = dot_row(qg, kp + at * D) * scale;
            if (has_bias) {
                const float c = cp[at];
                l = l + (c > 0.f ? (float)(alpha * std::log((double)c)) : NEG_INF);
            }
            p[i] = l;
            mx = l > mx ? l : mx;
        }
        for (int64_t j = 0; j < D; ++j) o[j] = 0.f;
        if (mx == NEG_INF) { lse[g] = NEG_INF; continue; }
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { const float x = std::exp(p[i] - mx); p[i] = x; sum += x; }
        Vec acc[DV];
        for (int64_t j = 0; j < DV; ++j) acc[j] = Vec(0.f);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t at = table[bh * M + i / S] * S + i % S;
            const Vec w(p[i] / sum);
            for (int64_t j = 0; j < DV; ++j) acc[j] = at::vec::fmadd(w, Vec::loadu(vp + at * D + j * L), acc[j]);
        }
        for (int64_t j = 0; j < DV; ++j) acc[j].store(o + j * L);
        lse[g] = mx + std::log(sum);
    }
}

// status[0]: 0 = done; 1 = some head's next entry has no page it owns in the appending tier (nothing changed).
// append_low: the new entry goes to the codes (a storage part that keeps every token as codes, its merge
// slots alone in floats), else to the float tier (mixed precision: generated tokens in the model's dtype).
extern "C" void kernel(const float* q, const float* k, const float* v, const int64_t* position,
                       float* hk, float* hv, float* hs, int64_t* hp, float* hc, const int64_t* htable,
                       int64_t* hlengths, const int64_t* howned, const int64_t HM, const int64_t HS,
                       uint8_t* kc, float* ks, float* kz, uint8_t* vc, float* vs, float* vz, float* ls, int64_t* lp,
                       float* lc, const int64_t* ltable, int64_t* llengths, const int64_t* lowned, const int64_t LM,
                       const int64_t LS, float* work, float* out_low, float* lse_low, float* out, const int64_t B,
                       const int64_t H, const float scale, const int64_t has_bias, const double* alpha_p,
                       const int64_t append_low, const int64_t max_threads, const int64_t items_per_thread,
                       const int64_t parallel_work, const int64_t bits, int64_t* status) {
    status[0] = 0;
    for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t col = append_low ? llengths[bh] / LS : hlengths[bh] / HS;
        if (col >= (append_low ? lowned[bh] : howned[bh]) || col >= (append_low ? LM : HM)) { status[0] = 1; return; }
    }
    if (append_low) {
        if (bits == 8)
            append_all<8>(k, v, position, kc, ks, kz, vc, vs, vz, ls, lp, lc, ltable, llengths, B, H, LM, LS);
        else
            append_all<4>(k, v, position, kc, ks, kz, vc, vs, vz, ls, lp, lc, ltable, llengths, B, H, LM, LS);
    } else {
        for (int64_t bh = 0; bh < B * H; ++bh) {  // LayerStore.append of float pages
            const int64_t e = hlengths[bh];
            const int64_t at = htable[bh * HM + e / HS] * HS + e % HS;
            for (int64_t j = 0; j < D; ++j) { hk[at * D + j] = k[bh * D + j]; hv[at * D + j] = v[bh * D + j]; }
            hs[at] = 0.f; hp[at] = position[bh / H]; hc[at] = 1.f;
            hlengths[bh] = e + 1;
        }
    }
    kvcompile_paged_attention_quant(q, kc, ks, kz, vc, vs, vz, ltable, llengths, nullptr, work, out_low, lse_low,
                                    B * H, LM, LS, 0, 1, scale, max_threads, items_per_thread, parallel_work, 0, bits);
    static thread_local std::vector<float> p;
    float lse_high[G], out_high[G * D];
    for (int64_t bh = 0; bh < B * H; ++bh) {
        high_attention(q, scale, hk, hv, hc, htable, HM, HS, bh, hlengths[bh], has_bias, alpha_p[0], p, lse_high,
                       out_high);
        for (int64_t g = 0; g < G; ++g) {  // merge_partials: the attention over the union of the two tiers
            const int64_t r = bh * G + g;
            const float a = lse_high[g], b = lse_low[r];
            float top = a > b ? a : b;
            if (top == NEG_INF) top = 0.f;
            const float wa = std::exp(a - top), wb = std::exp(b - top), den = wa + wb;
            const float inv_den = den > 0.f ? den : 1.f;
            for (int64_t j = 0; j < D; ++j) out[r * D + j] = (wa * out_high[g * D + j] + wb * out_low[r * D + j]) / inv_den;
        }
    }
}
