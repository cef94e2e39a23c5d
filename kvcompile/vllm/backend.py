"""vLLM's CPU attention backend with kvcompile's prompt compression (docs/VLLM.md "Design").

In the step that ends a request's prompt (the whole prompt: chunked prefill is refused), each layer,
after vLLM's own attention: the layer's prompt state (the last R = scoring.query_rows(N) queries, every
key and value, all after RoPE) is scored by the policy's scorer and selected by kvcompile's selection
(kvcompile.selection.select, the definition its engine is tested against), with the layer totals of
kvcompile.allocation; each KV head's K_{l,h} kept entries, in position order, are written (by vLLM's own
cache update, in its layout) into the request's slots of logical positions [N − K_{l,h}, N). Decode tokens are written by vLLM at N, N + 1, …
(slot mapping and RoPE positions unchanged). Any later attention of that request at layer l reads
positions [N − K_{l,h}, seq_len) of head h only: a masked torch attention over vLLM's paged layout
(vLLM's CPU kernel takes no per-request, per-head start), which replaces the kernel's output for those
requests' tokens. Keys carry their RoPE, so the slot a kept key sits in does not change its logits.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from kvcompile.layer_state import LayerState
from kvcompile.vllm.settings import PluginError, kept_counts


@dataclass
class Record:
    """A compressed request: its prompt length and each (layer, KV head)'s first logical position read."""

    prompt_length: int
    starts: torch.Tensor  # (L, H) long: N − K_{l,h}


@dataclass
class Step:
    """The worker's plugin state: the policy, this step's requests in batch order (request id, prompt
    length; set by the patched model runner), and the compressed requests' records."""

    policy: object = None
    requests: list | None = None
    records: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)  # request id -> {layer: [[positions] per head]} while recording
    record_to: str | None = None  # settings.RECORD_ENV


STEP = Step()


class KVCompileCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.isa != "vec":
            raise PluginError(f"kvcompile: vLLM's CPU attention picked isa {self.isa!r} (dtype {self.dtype}, head size "
                              f"{self.head_dim}, block {self.block_size}); the plugin reads the 'vec' layout only")

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if STEP.requests is None and common_attn_metadata.num_reqs and STEP.records:
            raise PluginError("kvcompile: the step's requests are unknown (a model runner the plugin does not patch?)")
        meta.kvcompile_requests = STEP.requests
        meta.kvcompile_layers = self.vllm_config.model_config.get_num_layers(self.vllm_config.parallel_config)
        return meta


class KVCompileCPUBackendImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        requests = getattr(attn_metadata, "kvcompile_requests", None)
        if not requests:
            return output
        index = extract_layer_index(layer.layer_name)
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        for i, (rid, n) in enumerate(requests):
            q0, q1, seq = starts[i], starts[i + 1], seq_lens[i]
            first = seq - (q1 - q0)
            record = STEP.records.get(rid)
            if record is not None and first >= n:
                out = self._attend_compressed(layer, query[q0:q1], kv_cache, attn_metadata.block_table[i],
                                              record.starts[index], first, seq)
                output[q0:q1] = out.reshape(output[q0:q1].shape)
            elif first < n <= seq:
                if first != 0 or seq != n:
                    raise PluginError(f"kvcompile: request {rid}'s prompt of {n} tokens came in a step covering "
                                      f"positions [{first}, {seq}) (chunked or recomputed): not one-pass compression")
                self._compress(layer, rid, n, index, attn_metadata.kvcompile_layers, query[q0:q1], key[q0:q1],
                               value[q0:q1], kv_cache, attn_metadata.block_table[i])
        return output

    def _compress(self, layer, rid, n, index, num_layers, query, key, value, kv_cache, block_row):
        """Score and select layer `index` of a whole n-token prompt; write each head's kept entries right-aligned."""
        from kvcompile.allocation import layer_totals
        from kvcompile.selection import select

        policy, heads = STEP.policy, key.shape[1]
        counts = kept_counts(policy, n, num_layers, heads)
        if int(counts.min()) >= n:
            return  # the budget covers the prompt at every (layer, head): nothing to do
        record = STEP.records.get(rid)
        if record is None:
            record = STEP.records[rid] = Record(n, n - counts)
        # the layout this reader assumes is checked on what vLLM just wrote: never read a cache wrongly
        keys, values = read_blocks(kv_cache, block_row, 0, n, layer.isa)
        if not (torch.equal(keys[:, :n], key.transpose(0, 1)) and torch.equal(values[:, :n], value.transpose(0, 1))):
            raise PluginError(f"kvcompile: vLLM's CPU cache layout for isa {layer.isa!r} is not the one the plugin "
                              "reads (keys [head_dim, block], values [block, head_dim])")
        rows = policy.scoring.query_rows(n)
        state = LayerState(query[n - rows:].transpose(0, 1)[None], key.transpose(0, 1)[None],
                           value.transpose(0, 1)[None], scale=self.scale)
        scores = policy.scoring.score(state)
        positions = torch.arange(n).expand(1, heads, n)
        valid = torch.ones(1, heads, n, dtype=torch.bool)
        total = layer_totals(policy, torch.tensor([n]), num_layers, heads)[:, index]
        kept = select(policy, scores, positions, valid, torch.tensor([n]), total, index)[0]  # (H, N)
        if not torch.equal(kept.sum(-1), counts[index]):
            raise PluginError(f"kvcompile: layer {index} kept {kept.sum(-1).tolist()} entries per head where the "
                              f"scheduler counted {counts[index].tolist()}")
        if STEP.record_to:
            layers = STEP.kept.setdefault(rid, {})
            layers[index] = [kept[h].nonzero().flatten().tolist() for h in range(heads)]
            if len(layers) == num_layers:
                with open(STEP.record_to, "a") as f:
                    f.write(json.dumps({"request": rid, "kept": [layers[j] for j in range(num_layers)]}) + "\n")
                del STEP.kept[rid]
        width = int(counts[index].max())
        if width >= n:
            return  # some head keeps everything: its entries are where they are, the others' too (start 0)
        # each head's kept entries right-aligned in positions [n - width, n); a head keeping fewer leaves its
        # first slots unread (its start is n - K_{l,h}); written by vLLM's own cache update (its layout)
        new_keys = key.new_zeros(width, heads, key.shape[-1])
        new_values = value.new_zeros(width, heads, value.shape[-1])
        for h in range(heads):
            source = kept[h].nonzero().flatten()
            new_keys[width - len(source):, h] = key[source, h]
            new_values[width - len(source):, h] = value[source, h]
        block_size = kv_cache.shape[2]
        target = torch.arange(n - width, n)
        slots = block_row[target // block_size].long() * block_size + target % block_size
        self.do_kv_cache_update(layer, new_keys, new_values, kv_cache, slots)

    def _attend_compressed(self, layer, query, kv_cache, block_row, starts, first, seq):
        """Attention of T query tokens at positions [first, seq) over each head's [start_h, position]."""
        begin = int(starts.min())
        keys, values = read_blocks(kv_cache, block_row, begin, seq, layer.isa)
        block_size = kv_cache.shape[2]
        pos = begin // block_size * block_size + torch.arange(keys.shape[1])
        qpos = torch.arange(first, seq)
        mask = (pos >= starts[:, None, None]) & (pos <= qpos[None, :, None])  # (H, T, S)
        group = self.num_queries_per_kv
        q = query.transpose(0, 1)  # (Hq, T, d)
        out = F.scaled_dot_product_attention(q, keys.repeat_interleave(group, 0).to(q.dtype),
                                             values.repeat_interleave(group, 0).to(q.dtype),
                                             attn_mask=mask.repeat_interleave(group, 0), scale=self.scale)
        return out.transpose(0, 1)  # (T, Hq, d)


def read_blocks(kv_cache, block_row, begin: int, end: int, isa: str):
    """Keys and values (H, S, d) of the blocks holding logical positions [begin, end), from the first
    position of begin's block. vLLM 0.32's CPU cache (LBHNC: [blocks, KV heads, block, 2·head_dim]) holds,
    per block and head, the keys as [head_dim, block] (the "vec" ISA's transposed layout) then the values as
    [block, head_dim]; other ISAs are refused (their layout is checked on the first prompt, see _compress)."""
    if isa != "vec":
        raise PluginError(f"kvcompile: vLLM's CPU attention isa {isa!r}: the plugin reads the 'vec' layout only")
    _, heads, block_size, width = kv_cache.shape
    d = width // 2
    ids = block_row[begin // block_size: -(-end // block_size)].long()
    raw = kv_cache[ids].reshape(len(ids), heads, 2, block_size * d)
    keys = raw[:, :, 0].reshape(len(ids), heads, d, block_size).transpose(-1, -2)
    values = raw[:, :, 1].reshape(len(ids), heads, block_size, d)
    return keys.transpose(0, 1).flatten(1, 2), values.transpose(0, 1).flatten(1, 2)


class KVCompileCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return KVCompileCPUBackendImpl

    @staticmethod
    def get_builder_cls():
        return KVCompileCPUMetadataBuilder
