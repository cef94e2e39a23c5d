"""vLLM's CPU attention backend with kvcompile's prompt compression (docs/VLLM.md "Design").

In the step that ends a request's prompt (the whole prompt, or its last chunk under chunked prefill: the
earlier chunks' queries among the last R are kept meanwhile), each layer, after vLLM's own attention, scores
the prompt with the policy's scorer (from the layer's prompt state: the last R = scoring.query_rows(N)
queries, every key and value, all after RoPE, the keys and values read back from the cache). After the last layer the
selection runs over every layer's scores (kvcompile.integrations.vllm.packing.kept_entries: the plan's own
selection, run by the engine, LAVa's cascade included), and every (layer, KV head)'s kept entries are packed into the request's
slots of positions [N − S, N), S = ⌈Σ K_{l,h} / (L·H)⌉, across heads and layers (kvcompile.integrations.vllm.packing).
The worker keeps where they are (a Record) and reports N − S with the step's output; the scheduler returns
the blocks wholly before it to vLLM's pool (kvcompile.integrations.vllm.patches).

Decode tokens are written by vLLM at N, N + 1, … (slot mapping and RoPE positions unchanged). Any later
attention of a compressed request at layer l attends head h over its K_{l,h} packed entries and its decode
entries (kvcompile.integrations.vllm.packed_attention: planned once per step by the metadata builder and run per
layer by the backend chosen for the model, the C++ kernel where it runs, else torch), in place of vLLM's kernel,
which is given only the new tokens of such requests (their seq_len cut to their query length) so it does not
attend over freed blocks for nothing.
Keys carry their RoPE, so where a kept key sits does not change its logits.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from kvcompile.layer_state import LayerState
from kvcompile.integrations.vllm.codes import Codes, slot_bytes
from kvcompile.integrations.vllm.packed_attention import (DecodePlan, PackedLayer, Record, choose, read_entries,
                                                          read_positions)
from kvcompile.integrations.vllm.packing import kept_entries, locations, region
from kvcompile.integrations.vllm.settings import PluginError, check_storage, engine_settings


@dataclass
class Pending:
    """A prompt being prefilled, in one step or in chunks over several: per layer, its queries at positions
    [N − R, N) seen so far (R = scoring.query_rows(N)), as (rows, Hq, d) pieces in position order; once its
    last chunk ran, every layer's scores (1, H, N) and its block row."""

    queries: dict = field(default_factory=dict)  # layer -> [query rows]
    scores: dict = field(default_factory=dict)
    block_row: torch.Tensor | None = None


@dataclass
class Worker:
    """One engine worker's plugin state, owned by its model runner's attention metadata builder (one per
    runner: the plugin runs one full-attention KV cache group) and living as long as it: the engine's policy
    (and where to record kept entries), this step's requests in batch order (request id, prompt length; set
    by the patched model runner before it builds the step's metadata), the prompts being compressed, the
    compressed requests' records, what this step compressed (N − S, read by the patched sample_tokens into
    the step's output), and every layer's cache tensor (vLLM allocates them once) with their addresses (for
    the C++ decode kernel, once all are known, where it runs). Each step's plan (StepPlan) carries it to the
    attention layers."""

    policy: object
    requests: list | None = None
    pending: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)
    reported: dict = field(default_factory=dict)  # request id -> N − S, compressed in this step (to the scheduler)
    caches: dict = field(default_factory=dict)  # layer index -> its kv cache tensor
    addresses: torch.Tensor | None = None  # every layer's cache address, in layer order
    record_to: str | None = None  # settings.RECORD_ENV
    needs_addresses: bool = True  # the decode backend's (PackedCpp: yes, PackedTorch: no)

    def cache(self, index: int, kv_cache: torch.Tensor, num_layers: int) -> None:
        """Layer `index`'s cache, as vLLM passes it to this step."""
        known = self.caches.get(index)
        if known is None or known.data_ptr() != kv_cache.data_ptr() or known.shape != kv_cache.shape:
            self.caches[index] = kv_cache
            self.addresses = None
        if self.needs_addresses and self.addresses is None and len(self.caches) == num_layers:
            caches = [self.caches[j] for j in range(num_layers)]
            # the kernel finds a cell of any layer from one shape: contiguous caches of one shape
            if not all(c.is_contiguous() and c.shape == caches[0].shape for c in caches):
                raise PluginError("kvcompile: the decode kernel reads every layer's KV cache as one contiguous "
                                  f"tensor of one shape; vLLM gave {[tuple(c.shape) for c in caches]} (contiguous: "
                                  f"{[c.is_contiguous() for c in caches]})")
            self.addresses = torch.tensor([c.data_ptr() for c in caches])


def worker_of(runner) -> Worker | None:
    """The plugin state of a vLLM model runner: its KVCompile metadata builder's (None before its attention
    is set up, e.g. in vLLM's profiling run)."""
    builders = [b for group in getattr(runner, "attn_groups", ()) for g in group for b in g.metadata_builders
                if isinstance(b, KVCompileCPUMetadataBuilder)]
    if len(builders) > 1:
        raise PluginError(f"kvcompile: the model runner has {len(builders)} attention metadata builders (micro-"
                          "batching?); the plugin runs one")
    return builders[0].worker if builders else None


@dataclass
class StepPlan:
    """What the plugin does in one step, planned once by the metadata builder: the compressed requests'
    decode attention (None: none decode in this step), the prompts to score, (batch row, request id, N,
    first query row), the model's layer count, and the worker's state it reads and updates."""

    decode: DecodePlan | None
    prompts: list
    layers: int
    worker: Worker


class KVCompileCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.isa != "vec":
            raise PluginError(f"kvcompile: vLLM's CPU attention picked isa {self.isa!r} (dtype {self.dtype}, head size "
                              f"{self.head_dim}, block {self.block_size}); the plugin reads the 'vec' layout only")
        config = self.vllm_config
        self.num_layers = config.model_config.get_num_layers(config.parallel_config)
        self.kv_heads = config.model_config.get_num_kv_heads(config.parallel_config)
        self.groups = config.model_config.get_num_attention_heads(config.parallel_config) // self.kv_heads
        settings = engine_settings(config)
        if settings is None:
            raise PluginError("kvcompile: the plugin's backend was built for an engine without kvcompile settings "
                              "(KVCOMPILE_VLLM_SPEC unset and no additional_config['kvcompile'])")
        policy = settings.policy()
        check_storage(policy, self.head_dim, self.dtype)
        # the decode backend, once for the model: the C++ kernel where it runs (built now), else torch
        self.attention = choose(self.groups, self.head_dim, self.dtype, Codes.of(policy.storage, self.head_dim))
        self.worker = Worker(policy, record_to=settings.record, needs_addresses=self.attention.needs_addresses)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        worker = self.worker
        requests = worker.requests
        if requests is None and common_attn_metadata.num_reqs and worker.records:
            raise PluginError("kvcompile: the step's requests are unknown (a model runner the plugin does not patch?)")
        seq_lens = common_attn_metadata.seq_lens.cpu()
        starts = common_attn_metadata.query_start_loc_cpu.tolist()
        decoding, prompts = [], []
        for i, (rid, n) in enumerate(requests or ()):
            seq = int(seq_lens[i])
            new = starts[i + 1] - starts[i]
            first = seq - new
            record = worker.records.get(rid)
            if record is not None and first >= n:
                decoding.append((i, record, starts[i], new, first))
            elif first < n:
                if seq > n:
                    raise PluginError(f"kvcompile: request {rid}'s prompt of {n} tokens came in a step covering "
                                      f"positions [{first}, {seq}) (recomputed after preemption): its outputs "
                                      "would attend before the prompt is compressed")
                prompts.append((i, rid, n, starts[i], first, seq))  # the whole prompt or a chunk of it
        if decoding:
            # vLLM's kernel attends a compressed request's new tokens only to themselves (their output is
            # replaced): never over its freed blocks, never over the whole context for nothing
            cut = seq_lens.clone()
            for i, _, _, new, _ in decoding:
                cut[i] = new
            common_attn_metadata = dataclasses.replace(
                common_attn_metadata, seq_lens=cut.to(common_attn_metadata.seq_lens.device))
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        decode = DecodePlan.plan(decoding, common_attn_metadata.block_table_tensor.cpu(), self.kv_heads,
                                 self.groups, self.head_dim, self.attention) if decoding else None
        meta.kvcompile = StepPlan(decode, prompts, self.num_layers, worker) if decoding or prompts else None
        return meta


class KVCompileCPUBackendImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        plan = getattr(attn_metadata, "kvcompile", None)
        if plan is None:
            return output
        index = extract_layer_index(layer.layer_name)
        worker = plan.worker
        worker.cache(index, kv_cache, plan.layers)
        if plan.decode is not None:
            plan.decode.run(index, query, output.view(output.shape[0], -1, self.head_size), worker.caches,
                            worker.addresses, self.scale)
        for i, rid, n, q0, first, seq in plan.prompts:
            rows = slice(q0, q0 + seq - first)
            self._score(worker, layer, rid, n, index, first, query[rows], key[rows], value[rows], kv_cache,
                        attn_metadata.block_table[i])
            if seq == n and index == plan.layers - 1:
                self._compress(worker, rid, n)
        return output

    def _score(self, worker, layer, rid, n, index, first, query, key, value, kv_cache, block_row):
        """Layer `index` of an n-token prompt's positions [first, first + T) (the whole prompt or a chunk): keep
        its queries among the last R, and in the chunk that ends the prompt score the layer (kept until the
        last layer: LAVa's cascade re-selects lower layers with what the later ones score) from those queries
        and every key and value of the prompt, read from the cache."""
        seq = first + len(query)
        # the layout this reader assumes is checked on what vLLM just wrote: never read a cache wrongly
        keys, values = read_positions(kv_cache, block_row, first, seq)
        if not (torch.equal(keys, key.transpose(0, 1)) and torch.equal(values, value.transpose(0, 1))):
            raise PluginError(f"kvcompile: vLLM's CPU cache layout for isa {layer.isa!r} is not the one the plugin "
                              "reads (keys [head_dim, block], values [block, head_dim])")
        policy = worker.policy
        rows = policy.scoring.query_rows(n)
        pending = worker.pending.setdefault(rid, Pending())
        if first == 0:  # the prompt's first chunk (again, if it was preempted before it ended)
            pending.queries[index] = []
        kept_from = max(first, n - rows)
        if kept_from < seq:
            pending.queries[index].append(query[kept_from - first:].clone())
        if seq < n:
            return
        if first > 0:
            keys, values = read_positions(kv_cache, block_row, 0, n)
        queries = torch.cat([query[:0], *pending.queries.pop(index)])  # no rows for a scorer reading none
        state = LayerState(queries.transpose(0, 1)[None], keys[None], values[None], scale=self.scale)
        pending.block_row = block_row.clone()
        pending.scores[index] = policy.scoring.score(state)

    def _compress(self, worker, rid, n):
        """After the last layer: select every layer's entries, pack them into [N − S, N) of the layers'
        caches, and record where they are."""
        pending = worker.pending.pop(rid)
        num_layers = len(pending.scores)
        kept = [k[0] for k in kept_entries(worker.policy, [pending.scores[j] for j in range(num_layers)])]
        counts = torch.stack([k.sum(-1) for k in kept])  # (L, H)
        if worker.record_to:
            with open(worker.record_to, "a") as f:
                f.write(json.dumps({"request": rid, "kept": [[k[h].nonzero().flatten().tolist()
                                                                for h in range(k.shape[0])] for k in kept]}) + "\n")
        caches, block_row = worker.caches, pending.block_row
        codes = Codes.of(worker.policy.storage, caches[0].shape[-1] // 2)  # None: the model's dtype
        if codes is None and bool((counts >= n).all()):
            return  # the budget covers the prompt at every (layer, head): nothing moves
        room = slot_bytes(caches[0])
        size = region(counts, codes, room)
        block_size = caches[0].shape[2]
        entries = []  # every layer's kept keys and values (E_l, d), read before anything is written
        for j in range(num_layers):
            head, position = kept[j].nonzero(as_tuple=True)  # (head, position) order
            entries.append(read_entries(caches[j], block_row, head, position))
        where = locations(counts, n, block_row, block_size, codes, room)
        layers = [PackedLayer(where[j], counts[j], codes) for j in range(num_layers)]
        for layer, (keys, values) in zip(layers, entries):
            layer.write(caches, keys, values)
        worker.records[rid] = record = Record(n, size, layers)
        worker.reported[rid] = record.first_slot  # to the scheduler, with this step's output (kvcompile.integrations.vllm.patches)


class KVCompileCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return KVCompileCPUBackendImpl

    @staticmethod
    def get_builder_cls():
        return KVCompileCPUMetadataBuilder
