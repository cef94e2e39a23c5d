"""vLLM's CPU attention backend with kvcompile's prompt compression (docs/VLLM.md "Design").

In the step that ends a request's prompt (the whole prompt: chunked prefill is refused), each layer, after
vLLM's own attention over the prompt, scores it with the policy's scorer (from the layer's prompt state: the
last R = scoring.query_rows(N) queries, every key and value, all after RoPE). After the last layer the
selection runs over every layer's scores (kvcompile.vllm.packing.kept_entries: kvcompile's reference
selection, LAVa's cascade included), and every (layer, KV head)'s kept entries are packed into the request's
slots of positions [N − S, N), S = ⌈Σ K_{l,h} / (L·H)⌉, across heads and layers (kvcompile.vllm.packing).
The worker keeps where they are (a Record) and reports N − S with the step's output; the scheduler returns
the blocks wholly before it to vLLM's pool (kvcompile.vllm.patches).

Decode tokens are written by vLLM at N, N + 1, … (slot mapping and RoPE positions unchanged). Any later
attention of a compressed request at layer l gathers head h's K_{l,h} packed entries and its decode entries
and attends over them (a padded, masked torch attention), in place of vLLM's kernel, which is given only the
new tokens of such requests (their seq_len cut to their query length) so it does not attend over freed
blocks for nothing. Keys carry their RoPE, so where a kept key sits does not change its logits.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from kvcompile.layer_state import LayerState
from kvcompile.vllm.packing import assign, kept_entries, padded, region, slots
from kvcompile.vllm.settings import PluginError


@dataclass
class PackedLayer:
    """One layer's kept entries of a compressed request as a padded batch of its heads, (H, W), W = max_h
    K_{l,h}: for each layer tensor that holds some of them, which of the (H, W) places it fills (None: all)
    and their block ids, columns and offsets there; valid (H, W) marks the K_{l,h} real entries of each head
    (the others repeat a real one and are masked)."""

    sources: list  # [(source layer, places (H, W) bool or None, blocks, columns, offsets)]
    valid: torch.Tensor

    def gather(self, caches: dict, like: torch.Tensor):
        """Keys and values (H, W, d) of this layer's packed entries, read from the caches."""
        if self.sources[0][1] is None:  # one tensor holds them all
            t, _, b, c, o = self.sources[0]
            return key_view(caches[t])[b, c, :, o], value_view(caches[t])[b, c, o]
        heads, width = self.valid.shape
        keys = like.new_empty(heads, width, like.shape[-1])
        values = like.new_empty(heads, width, like.shape[-1])
        for t, places, b, c, o in self.sources:
            keys[places] = key_view(caches[t])[b, c, :, o]
            values[places] = value_view(caches[t])[b, c, o]
        return keys, values


@dataclass
class Record:
    """A compressed request: its prompt length N, the slots S its packed entries hold ([N − S, N)), and
    where each layer's entries are."""

    prompt_length: int
    region: int
    layers: list  # [PackedLayer] per layer

    @property
    def first_slot(self) -> int:
        """N − S: the blocks wholly before this position are freed."""
        return self.prompt_length - self.region


@dataclass
class Pending:
    """A prompt in its step: every layer's scores so far (1, H, N), and its block row."""

    block_row: torch.Tensor
    scores: dict = field(default_factory=dict)


@dataclass
class Step:
    """The worker's plugin state (the engine core's process: the scheduler reads `records`): the policy,
    this step's requests in batch order (request id, prompt length; set by the patched model runner), the
    prompts being compressed in this step, the compressed requests' records, and every layer's cache
    tensor (vLLM allocates them once)."""

    policy: object = None
    requests: list | None = None
    pending: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)
    reported: dict = field(default_factory=dict)  # request id -> N − S, compressed in this step (to the scheduler)
    caches: dict = field(default_factory=dict)  # layer index -> its kv cache tensor
    record_to: str | None = None  # settings.RECORD_ENV


STEP = Step()


class KVCompileCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.isa != "vec":
            raise PluginError(f"kvcompile: vLLM's CPU attention picked isa {self.isa!r} (dtype {self.dtype}, head size "
                              f"{self.head_dim}, block {self.block_size}); the plugin reads the 'vec' layout only")

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        requests = STEP.requests
        if requests is None and common_attn_metadata.num_reqs and STEP.records:
            raise PluginError("kvcompile: the step's requests are unknown (a model runner the plugin does not patch?)")
        seq_lens = common_attn_metadata.seq_lens.cpu()
        starts = common_attn_metadata.query_start_loc_cpu.tolist()
        if requests and STEP.records:
            # vLLM's kernel attends a compressed request's new tokens only to themselves (their output is
            # replaced): never over its freed blocks, never over the whole context for nothing
            cut = seq_lens.clone()
            for i, (rid, n) in enumerate(requests):
                record = STEP.records.get(rid)
                new = starts[i + 1] - starts[i]
                if record is not None and int(seq_lens[i]) - new >= n:
                    cut[i] = new
            common_attn_metadata = dataclasses.replace(
                common_attn_metadata, seq_lens=cut.to(common_attn_metadata.seq_lens.device))
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta.kvcompile_requests = requests
        meta.kvcompile_starts = starts
        meta.kvcompile_seq_lens = seq_lens.tolist()
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
        STEP.caches[index] = kv_cache
        starts, seq_lens = attn_metadata.kvcompile_starts, attn_metadata.kvcompile_seq_lens
        num_layers = attn_metadata.kvcompile_layers
        for i, (rid, n) in enumerate(requests):
            q0, q1, seq = starts[i], starts[i + 1], seq_lens[i]
            first = seq - (q1 - q0)
            record = STEP.records.get(rid)
            if record is not None and first >= n:
                out = self._attend_compressed(query[q0:q1], kv_cache, attn_metadata.block_table[i],
                                              record, index, first, seq)
                output[q0:q1] = out.reshape(output[q0:q1].shape)
            elif first < n <= seq:
                if first != 0 or seq != n:
                    raise PluginError(f"kvcompile: request {rid}'s prompt of {n} tokens came in a step covering "
                                      f"positions [{first}, {seq}) (chunked or recomputed): not one-pass compression")
                self._score(layer, rid, n, index, query[q0:q1], key[q0:q1], value[q0:q1], kv_cache,
                            attn_metadata.block_table[i])
                if index == num_layers - 1:
                    self._compress(rid, n)
        return output

    def _score(self, layer, rid, n, index, query, key, value, kv_cache, block_row):
        """Score layer `index` of a whole n-token prompt (kept until the last layer: LAVa's cascade
        re-selects lower layers with what the later ones score)."""
        # the layout this reader assumes is checked on what vLLM just wrote: never read a cache wrongly
        keys, values = read_positions(kv_cache, block_row, 0, n)
        if not (torch.equal(keys, key.transpose(0, 1)) and torch.equal(values, value.transpose(0, 1))):
            raise PluginError(f"kvcompile: vLLM's CPU cache layout for isa {layer.isa!r} is not the one the plugin "
                              "reads (keys [head_dim, block], values [block, head_dim])")
        policy = STEP.policy
        rows = policy.scoring.query_rows(n)
        state = LayerState(query[n - rows:].transpose(0, 1)[None], key.transpose(0, 1)[None],
                           value.transpose(0, 1)[None], scale=self.scale)
        pending = STEP.pending.setdefault(rid, Pending(block_row.clone()))
        pending.scores[index] = policy.scoring.score(state)

    def _compress(self, rid, n):
        """After the last layer: select every layer's entries, pack them into [N − S, N) of the layers'
        caches, and record where they are."""
        pending = STEP.pending.pop(rid)
        num_layers = len(pending.scores)
        kept = [k[0] for k in kept_entries(STEP.policy, [pending.scores[j] for j in range(num_layers)])]
        counts = torch.stack([k.sum(-1) for k in kept])  # (L, H)
        if STEP.record_to:
            with open(STEP.record_to, "a") as f:
                f.write(json.dumps({"request": rid, "kept": [[k[h].nonzero().flatten().tolist()
                                                                for h in range(k.shape[0])] for k in kept]}) + "\n")
        if bool((counts >= n).all()):
            return  # the budget covers the prompt at every (layer, head): nothing moves
        size, heads = region(counts), counts.shape[1]
        caches, block_row = STEP.caches, pending.block_row
        block_size = caches[0].shape[2]
        entries = []  # every layer's kept keys and values (E_l, d), read before anything is written
        for j in range(num_layers):
            head, position = kept[j].nonzero(as_tuple=True)  # (head, position) order
            entries.append(read_entries(caches[j], block_row, head, position))
        layers = []
        for j, groups in enumerate(assign(counts)):
            where = []  # (tensor, block, column, offset) of each entry, in (head, position) order
            for g in groups:
                blocks, columns, offsets = slots(g.locations, n, size, heads, block_row, block_size)
                end = g.start + len(g.locations)
                key_view(caches[g.tensor])[blocks, columns, :, offsets] = entries[j][0][g.start:end]
                value_view(caches[g.tensor])[blocks, columns, offsets] = entries[j][1][g.start:end]
                where.append(torch.stack([torch.full_like(blocks, g.tensor), blocks, columns, offsets]))
            index, valid = padded(counts[j])
            if not where:  # the layer keeps nothing: its heads attend to their decode entries only
                layers.append(PackedLayer([], valid))
                continue
            t, b, c, o = torch.cat(where, 1)[:, index]  # each (H, W)
            sources = [(int(u), t == u, *(x[t == u] for x in (b, c, o)))
                       for u in t.unique()] if len(groups) > 1 else [(groups[0].tensor, None, b, c, o)]
            layers.append(PackedLayer(sources, valid))
        STEP.records[rid] = record = Record(n, size, layers)
        STEP.reported[rid] = record.first_slot  # to the scheduler, with this step's output (kvcompile.vllm.patches)

    def _attend_compressed(self, query, kv_cache, block_row, record, index, first, seq):
        """Attention of T query tokens at positions [first, seq): head h over its packed entries and the
        decode entries at positions [N, position]."""
        packed = record.layers[index]
        new_keys, new_values = read_positions(kv_cache, block_row, record.prompt_length, seq)
        if packed.sources:
            keys, values = packed.gather(STEP.caches, query)
            keys, values = torch.cat([keys, new_keys], 1), torch.cat([values, new_values], 1)  # (H, W + D, d)
        else:
            keys, values = new_keys, new_values
        qpos = torch.arange(first, seq)
        kpos = torch.arange(record.prompt_length, seq)
        mask = torch.cat([packed.valid[:, None, :].expand(-1, len(qpos), -1),
                          (kpos[None, None, :] <= qpos[None, :, None]).expand(len(packed.valid), -1, -1)], -1)
        q = query.transpose(0, 1)  # (Hq, T, d)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), scale=self.scale,
                                             attn_mask=mask.repeat_interleave(self.num_queries_per_kv, 0),
                                             enable_gqa=True)
        return out.transpose(0, 1)  # (T, Hq, d)


def key_view(kv_cache):
    """Keys of vLLM 0.32's CPU cache under the "vec" ISA, (blocks, KV heads, head_dim, block): the cache
    is [blocks, KV heads, block, 2·head_dim], each (block, head) holding its keys as [head_dim, block] then
    its values as [block, head_dim]; other ISAs are refused (the layout is checked on every prompt)."""
    blocks, heads, block_size, width = kv_cache.shape
    return kv_cache.view(blocks, heads, 2, width // 2, block_size)[:, :, 0]


def value_view(kv_cache):
    """Values of the same cache, (blocks, KV heads, block, head_dim)."""
    blocks, heads, block_size, width = kv_cache.shape
    return kv_cache.view(blocks, heads, 2, block_size, width // 2)[:, :, 1]


def read_entries(kv_cache, block_row, head, position):
    """Keys and values (..., d) of a request's entries at KV heads `head` and logical positions `position`
    (long tensors broadcast together; block_row its block ids)."""
    block_size = kv_cache.shape[2]
    blocks, offsets = block_row[position // block_size].long(), position % block_size
    return key_view(kv_cache)[blocks, head, :, offsets], value_view(kv_cache)[blocks, head, offsets]


def read_positions(kv_cache, block_row, begin: int, end: int):
    """Keys and values (H, end − begin, d) of every KV head at logical positions [begin, end)."""
    return read_entries(kv_cache, block_row, torch.arange(kv_cache.shape[1])[:, None], torch.arange(begin, end))


class KVCompileCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return KVCompileCPUBackendImpl

    @staticmethod
    def get_builder_cls():
        return KVCompileCPUMetadataBuilder
