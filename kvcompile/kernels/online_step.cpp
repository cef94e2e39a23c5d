// One decode step of a layer whose scores run or that evicts online (ZSMerge), fused (fp32):
// append, attention with the merge bias, running-score update, victim choice and fresh slot /
// fold / drop with removal. Built by kvcompile/kernels/online_step.py through Inductor's C++
// toolchain; the contract (and the Python path it equals) is in that module's docstring.
// Single-threaded, no allocation besides a reused scratch, nothing returned to Python but status.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

// The loader defines KVCOMPILE_G and KVCOMPILE_D before this file: one build per (G, D).
constexpr int64_t G = KVCOMPILE_G, D = KVCOMPILE_D;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();
constexpr int64_t DV = D / L;  // whole vectors of a row; D % L lanes are a scalar tail
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

static inline float dot(const float* a, const float* b) {
    float s = 0.f;
    if constexpr (DV > 0) {
        Vec acc(0.f);
        for (int64_t j = 0; j < DV * L; j += L) acc = acc + Vec::loadu(a + j) * Vec::loadu(b + j);
        s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
    }
    for (int64_t j = DV * L; j < D; ++j) s += a[j] * b[j];
    return s;
}

// status[0]: 0 = done; 1 = some head's next entry has no page (nothing was changed: the engine makes room
// before the step, so this is an error); 2 = a head holds more residual slots than its split allows (an
// error, as the engine's path raises it). Evicting, a head over proximity + context after the append loses
// one token a round until it is within them (several rounds: the first step after a prompt that filled it).
extern "C" void kernel(const float* q, const float* k, const float* v, const int64_t* position,
                       float* kp, float* vp, float* sp, int64_t* pp, float* cp, const int64_t* table,
                       int64_t* lengths, int64_t* slots, const int64_t* owned, const int64_t* split,
                       float* out, const int64_t B, const int64_t H, const int64_t M, const int64_t S,
                       const float scale, const int64_t running, const float decay, const int64_t gqa_max,
                       const int64_t has_bias, const double* alpha_p, const int64_t evict, int64_t* status) {
    const double alpha = alpha_p[0];
    status[0] = 0;
    int64_t widest = 0;
    for (int64_t bh = 0; bh < B * H; ++bh) {  // pass 1: every head has a page, or nothing is touched
        const int64_t e = lengths[bh];
        if (e / S >= owned[bh] || e / S >= M) { status[0] = 1; return; }
        widest = std::max(widest, e + 1);
        if (!evict) continue;
        const int64_t* tb = table + bh * M;
        int64_t ntok = 1, held = 0;
        for (int64_t i = 0; i < e; ++i) {
            const bool token = pp[tb[i / S] * S + i % S] >= 0;
            ntok += token;
            held += !token;
        }
        if (ntok - split[bh * 3] - split[bh * 3 + 1] >= 1 && held > split[bh * 3 + 2]) { status[0] = 2; return; }
    }
    static thread_local std::vector<int64_t> idx, recent;
    static thread_local std::vector<float> probs, reduced;
    idx.resize(widest); recent.resize(widest); probs.resize(G * widest); reduced.resize(widest);
    for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t b = bh / H;
        const int64_t* tb = table + bh * M;
        // append (cache.append without a fresh page)
        const int64_t e = lengths[bh];
        const int64_t at = tb[e / S] * S + e % S;
        for (int64_t j = 0; j < D; ++j) { kp[at * D + j] = k[bh * D + j]; vp[at * D + j] = v[bh * D + j]; }
        sp[at] = 0.f; pp[at] = position[b]; cp[at] = 1.f;
        const int64_t n = e + 1;
        lengths[bh] = n;
        for (int64_t i = 0; i < n; ++i) idx[i] = tb[i / S] * S + i % S;
        // attention of the G query heads with the merge bias alpha * log(w) (-inf for w = 0)
        for (int64_t g = 0; g < G; ++g) {
            const float* qg = q + (bh * G + g) * D;
            float* p = probs.data() + g * widest;
            float mx = NEG_INF;
            for (int64_t i = 0; i < n; ++i) {
                float l = dot(qg, kp + idx[i] * D) * scale;
                if (has_bias) {
                    const float c = cp[idx[i]];
                    l = l + (c > 0.f ? (float)(alpha * std::log((double)c)) : NEG_INF);
                }
                p[i] = l;
                mx = l > mx ? l : mx;
            }
            float sum = 0.f;
            for (int64_t i = 0; i < n; ++i) { const float x = std::exp(p[i] - mx); p[i] = x; sum += x; }
            const float inv = 1.f / sum;
            Vec acc[DV > 0 ? DV : 1];
            float tail[D % L > 0 ? D % L : 1];
            for (int64_t j = 0; j < DV; ++j) acc[j] = Vec(0.f);
            for (int64_t j = 0; j < D % L; ++j) tail[j] = 0.f;
            for (int64_t i = 0; i < n; ++i) {
                const float w = p[i] * inv;
                p[i] = w;
                const float* vi = vp + idx[i] * D;
                const Vec wv(w);
                for (int64_t j = 0; j < DV; ++j) acc[j] = acc[j] + wv * Vec::loadu(vi + j * L);
                for (int64_t j = 0; j < D % L; ++j) tail[j] += w * vi[DV * L + j];
            }
            float* o = out + (bh * G + g) * D;
            for (int64_t j = 0; j < DV; ++j) acc[j].store(o + j * L);
            for (int64_t j = 0; j < D % L; ++j) o[DV * L + j] = tail[j];
        }
        // running scores of the token entries: s <- decay * s + a, a reduced over the group (mean | max)
        if (running) {
            for (int64_t i = 0; i < n; ++i) {
                float r = probs[i];
                if (gqa_max) { for (int64_t g = 1; g < G; ++g) r = std::max(r, probs[g * widest + i]); }
                else { for (int64_t g = 1; g < G; ++g) r += probs[g * widest + i]; r = r / (float)G; }
                reduced[i] = r;
            }
            for (int64_t i = 0; i < n; ++i)
                if (pp[idx[i]] >= 0) { const float t = decay * sp[idx[i]]; sp[idx[i]] = t + reduced[i]; }
        }
        if (!evict) continue;
        // online eviction (ZSMerge Alg. 1): a token over proximity + context leaves, a round at a time
        const int64_t prox = split[bh * 3], context = split[bh * 3 + 1], nslots = split[bh * 3 + 2];
        for (int64_t n = lengths[bh];; n = lengths[bh]) {
        int64_t ntok = 0, held = 0;
        for (int64_t i = 0; i < n; ++i) { if (pp[idx[i]] >= 0) recent[ntok++] = pp[idx[i]]; else ++held; }
        if (ntok - prox - context < 1) break;
        // the latest `prox` tokens stay: positions >= cut (positions of a head's tokens are distinct)
        int64_t cut = std::numeric_limits<int64_t>::max();
        if (prox > 0) {
            std::nth_element(recent.begin(), recent.begin() + (prox - 1), recent.begin() + ntok, std::greater<int64_t>());
            cut = recent[prox - 1];
        }
        // victim: the lowest running score, ties: the earliest position
        int64_t victim = -1;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t pi = pp[idx[i]];
            if (pi < 0 || pi >= cut) continue;
            if (victim < 0) { victim = i; continue; }
            const float a = sp[idx[i]], best = sp[idx[victim]];
            if (a < best || (a == best && pi < pp[idx[victim]])) victim = i;
        }
        const int64_t ve = idx[victim];
        if (nslots > 0 && held < nslots) {  // a free slot: the victim becomes slot `held` in place
            pp[ve] = -1 - held; sp[ve] = 0.f; slots[bh] += 1;
            continue;  // (the next round)
        }
        if (nslots > 0) {  // fold into the slot of largest k_r . k (ties: the lowest r = the highest position)
            int64_t target = -1;
            float bd = NEG_INF;
            for (int64_t i = 0; i < n; ++i) {
                const int64_t ei = idx[i];
                if (pp[ei] >= 0) continue;
                const float d = dot(kp + ei * D, kp + ve * D);
                if (target < 0 || d > bd || (d == bd && pp[ei] > pp[target])) { target = ei; bd = d; }
            }
            const float w = cp[target];  // (w * slot + x) / (w + 1), rounded as the torch path rounds it
            for (int64_t j = 0; j < D; ++j) {
                const float ks = w * kp[target * D + j], kt = ks + kp[ve * D + j];
                kp[target * D + j] = kt / (w + 1.f);
                const float vs = w * vp[target * D + j], vt = vs + vp[ve * D + j];
                vp[target * D + j] = vt / (w + 1.f);
            }
            cp[target] = w + 1.f;
        }
        // remove the victim (cache.remove): the head's last entry moves into its place
        const int64_t last = idx[n - 1];
        for (int64_t j = 0; j < D; ++j) { kp[ve * D + j] = kp[last * D + j]; vp[ve * D + j] = vp[last * D + j]; }
        sp[ve] = sp[last]; pp[ve] = pp[last]; cp[ve] = cp[last];
        lengths[bh] = n - 1;
        }
    }
}
