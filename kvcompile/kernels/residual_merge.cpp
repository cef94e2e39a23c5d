// ZSMerge's residual merge of a layer's evicted prompt tokens (Alg. 1 lines 11–15, Eq. 6–7),
// fp32: each (sequence, KV head) walks its evicted tokens in merge order; a token fills the
// first empty usable slot, else folds into the usable slot of largest k_r·k (lowest r on
// ties): k_r ← (w·k_r + k)/(w + 1), the same for v, w ← w + 1. Built by
// kvcompile/kernels/merge.py (residual_merge_cpp) through Inductor's C++ toolchain, whose
// flags keep the multiply, add and divide separately rounded (no contraction into an FMA),
// as the torch lowering and the reference compute them. Heads run on OpenMP threads.
#include <torch/csrc/inductor/cpp_prefix.h>
#include <cstdint>

// sk (BH, S, D), sv (BH, S, DV), counts (BH, S): updated in place; keys (BH, E, D),
// values (BH, E, DV): the tokens in merge order, num[bh] of them; num_slots[bh]: usable slots.
extern "C" void kernel(float* sk, float* sv, int64_t* counts, const float* keys, const float* values,
                       const int64_t* num, const int64_t* num_slots, const int64_t BH, const int64_t S,
                       const int64_t D, const int64_t DV, const int64_t E, const int64_t threads) {
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if(threads > 1)
    for (int64_t bh = 0; bh < BH; ++bh) {
        const int64_t usable = num_slots[bh] < S ? num_slots[bh] : S;
        if (usable <= 0) continue;  // no slot: the evicted tokens are dropped
        float* hk = sk + bh * S * D;
        float* hv = sv + bh * S * DV;
        int64_t* hc = counts + bh * S;
        for (int64_t e = 0; e < num[bh]; ++e) {
            const float* k = keys + (bh * E + e) * D;
            const float* v = values + (bh * E + e) * DV;
            int64_t target = -1;
            for (int64_t r = 0; r < usable && target < 0; ++r)
                if (hc[r] == 0) target = r;
            if (target < 0) {
                float best = 0.f;
                for (int64_t r = 0; r < usable; ++r) {
                    float dot = 0.f;
                    for (int64_t j = 0; j < D; ++j) dot += hk[r * D + j] * k[j];
                    if (target < 0 || dot > best) { best = dot; target = r; }
                }
            }
            const float w = static_cast<float>(hc[target]);
            for (int64_t j = 0; j < D; ++j) hk[target * D + j] = (w * hk[target * D + j] + k[j]) / (w + 1.f);
            for (int64_t j = 0; j < DV; ++j) hv[target * DV + j] = (w * hv[target * DV + j] + v[j]) / (w + 1.f);
            hc[target] += 1;
        }
    }
}
