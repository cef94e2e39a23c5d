"""The plan: what `compile()` decides once, and the runtime only reads (docs/INTERNALS.md "The pipeline").

    plan = build_plan(policy, model.config, device=..., dtype=..., kernels=None, page_size=16)
    cache = KVCompileCache.from_plan(plan.with_headroom(max_new_tokens))

From the Policy, the model's config, the device and dtype, the kernel choice, the page
size, the generation headroom and the tensor-parallel shard (kvcompile.sharding) the plan names:
- the implementations: the prompt scorer (the fused window-scoring kernel, or the
  scorer part's own memory-bounded path), the selection and gather kernels, the batched
  merge of the prompt's evicted tokens, the decode attention kernel;
- what decoding does: running scores, online eviction, pruning every n tokens, the ring
  of latest queries that pruning re-scores with, the spare pages per head;
- whether the prompt runs as a cascade, which KV heads this process holds and, under tensor
  parallelism, what its selections gather from the other ranks (`heads_exchange`).

This module and the part classes are the only places that look at which parts a policy
has; the runtime reads the fields below. Kernel names are resolved here, once
(`kvcompile.kernels.choice.resolve`), into backends: one object per kernel family, of the class
of its implementation (`kvcompile.kernels.paged_attention.CppPagedAttention`, ...), which the plan
holds and the runtime calls (`plan.decode_attention(q, k_pages, ...)`) without comparing names; the
thresholds that decide threading are their fields, and `describe()` shows them. A bad choice fails
at compile(), not mid-generation. A plan built without a device or dtype (a KVCompileCache made from
a policy and a config) holds no backend until its cache's first prompt binds it to the prompt's
tensors (`bound_to`, once); a bound plan refuses tensors of another device or dtype.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.layer_kinds import LayerKindError, LayerKinds, layer_kinds
from kvcompile.layer_state import LayerState
from kvcompile.policies.merge import Drop, Residual
from kvcompile.policy import Policy
from kvcompile.sharding import HeadShard
from kvcompile.store import store_class


@dataclass(frozen=True)
class StepRule:
    """What a decode step does besides attention when scores run or tokens leave online, as the
    numbers the fused step (kvcompile.kernels.online_step) computes with, read off the parts:
    decay: the running update s ← decay·s + a (Scorer.running_decay: λ; 1 for accumulated),
        None when the scores do not run; gqa_max: the group reduce of a (Scorer.gqa: max, else
        mean); alpha: the logit bias α·log w of every entry (MergeRule.bias_alpha), None when the
        policy does not merge (no bias); evict: online eviction through the split (ZSMerge Alg. 1)."""

    decay: float | None
    gqa_max: bool
    alpha: float | None
    evict: bool


class PlanError(ValueError):
    """The policy cannot run on this model, device or kernel choice (said before anything runs)."""


@dataclass(frozen=True)
class Plan:
    """Everything the runtime needs to run one policy on one model, decided once."""

    policy: Policy
    num_layers: int
    num_heads: int  # KV heads of the model
    head_dim: int
    kv_heads: tuple[int, ...]  # the KV heads whose pages this process holds (all of them on one process)
    shard: HeadShard | None  # tensor parallelism: this rank's heads and the group's collectives (None: one process)
    heads_exchange: str  # what a tensor-parallel selection gathers: "none" (one process, or a threshold whose
    #   heads cut alone), "counts" (every head's candidate and slot counts: each head's selection reads its own
    #   scores given the head budgets), "scores" (every head's scores: pooled heads, entropy layer budgets)
    device: torch.device | None  # None: decided by the first prompt's tensors (bound_to)
    dtype: torch.dtype | None
    kernels: str | None  # what the caller asked for (None = the defaults below)
    compiled_entry: bool  # the model runs the compiled entry (torch.compile + the kvcompile passes)
    page_size: int
    headroom: int  # tokens per head generation may add after the prompt
    # implementations: the backends the runtime calls (kvcompile.kernels.*), chosen once by build_plan;
    # None in a plan without device or dtype until it is bound (bound_to)
    prompt_scores: object  # the prompt's scores: PartScores (the scorer part's own score_prompt) | a
    #   kernels.window_scores backend (the fused window kernel) | kernels.attention_column_sums.ColumnSumScores
    #   (the prompt's attention computes the score)
    selection: object  # selection and gather (a kernels.select backend)
    prompt_merge: object  # the prompt's residual merge (a kernels.merge backend); None: the rule's own merge
    decode_attention: object  # paged decode attention (a kernels.paged_attention backend)
    decode_step: object  # the decode step backend, called once a layer and step and never declining one
    #   (kvcompile.kernels.online_step: append, attention; running scores, online eviction where the policy has
    #   them): a fused C++ step (store.pages' CppOnlineStep and CppAppendStep, tiered_step.CppTieredStep) where one
    #   computes the policy on the plan's store, dtype and device, else engine.online.TorchStep (complete)
    step_rule: StepRule | None  # what a fused step computes (None: the torch step's parts compute it)
    # decoding
    running_scores: bool  # scores keep running while decoding (H2O, ZSMerge)
    online_eviction: bool  # one token per head and step leaves through the split (ZSMerge Alg. 1)
    prune_every: int  # re-score and prune every n generated tokens (0: never)
    ring_rows: int  # latest queries kept per layer for that re-scoring (0: none)
    spare_pages: int  # the most pages a head gets beyond its prompt pages for its decode appends (it gets the
    #   pages of `spare_entries` more entries), and the run a head past them takes
    # prefill
    cascade: bool  # layer budgets move with the scores of later layers (LAVa Alg. 2)
    lazy_cascade: bool  # the cascade's re-selections may wait: the heads rule is nested (see HeadsRule)
    static_totals: bool  # layer totals are known from the prompt lengths alone
    prefill_chunk: int = 0  # the prompt runs in chunks of this many tokens, each compressed back to the budget
    #   before the next (schedule.prefill: chunk; reference.ChunkedPrefill); 0: one pass
    layer_devices: tuple[torch.device, ...] | None = None  # each layer's device where the layers run on several
    #   (a pipeline over GPUs, kvcompile.devices.execution_devices; `device` is layer 0's); None: all on `device`
    chunk_attention: object = None  # a chunk's attention over the held entries and itself (a
    #   kernels.chunk_attention backend: CppChunkAttention, the column-sums kernel with the held entries as a
    #   biased prefix, or SdpaChunkAttention, SDPA with a mask)
    rope: tuple[float, ...] | None = None  # the model's rotary inverse frequencies, for a scorer that reads them
    #   (Scorer.needs_rope: expected_attention moves queries to future positions); None: the scorer reads none
    nope: tuple[bool, ...] | None = None  # with `rope`, on Llama 4 (no_rope_layers): per compressed layer, whether
    #   it is a NoPE layer (no rotary; `temperature` scales its queries), else it rotates interleaved pairs;
    #   None: every layer rotates by `rope` in transformers' rotate-half layout
    temperature: tuple[float, float] | None = None  # with `nope`: Llama 4's attn_temperature_tuning
    #   (attn_scale, floor_scale), the scale by position of its NoPE layers' queries; None: off
    softcap: float | None = None  # the model's attention logit soft-cap (Gemma 2's attn_logit_softcapping:
    #   cap·tanh(s/cap) before the softmax), applied by every attention the plan runs; None: none
    sinks: tuple[tuple[float, ...] | None, ...] | None = None  # per model layer, its learned sinks (gpt-oss's
    #   self_attn.sinks: one logit per query head in the softmax's denominator), read off the model by compile();
    #   None: the model has none
    layer_kinds: LayerKinds | None = None  # a hybrid model's layers (kvcompile.layer_kinds): which the policy
    #   compresses (num_layers counts those, numbered in the model's order) and which are left to their window;
    #   None: every layer is a full_attention layer the policy compresses

    store: type = None  # the class of every layer's page store (kvcompile.store.store_class): how entries are held

    def __post_init__(self):
        """A decode step that does not compute this plan's store, dtype or device is refused here, when the plan
        is made (not at a step)."""
        step = self.decode_step
        why = None if step is None else step.refuses(self)
        if why is not None:
            raise PlanError(f"kvcompile: the decode step {step.describe()} cannot run {self.policy.name}: {why}")

    def model_layer_sinks(self, layer: int, device) -> Tensor | None:
        """Model layer `layer`'s learned sinks (Hq,) on `device`, or None."""
        if self.sinks is None or self.sinks[layer] is None:
            return None
        return torch.tensor(self.sinks[layer], dtype=torch.float32, device=device)

    def layer_sinks(self, layer: int, device) -> Tensor | None:
        """The learned sinks of the engine's layer `layer` (a hybrid model's: of its layer-th compressed layer)."""
        if self.sinks is None:
            return None
        model = layer if self.layer_kinds is None else self.layer_kinds.engine.index(layer)
        return self.model_layer_sinks(model, device)

    def decode_backend(self, layer: int, device):
        """The decode attention backend of the engine's layer `layer`: decode_attention, with the layer's sinks
        where the model has them."""
        return self._with_layer_sinks(self.decode_attention, layer, device)

    def chunk_backend(self, layer: int, device):
        """The chunk attention backend of the engine's layer `layer` (schedule.prefill: chunk): chunk_attention,
        with the layer's sinks where the model has them."""
        return self._with_layer_sinks(self.chunk_attention, layer, device)

    def _with_layer_sinks(self, backend, layer: int, device):
        return backend if self.sinks is None else backend.with_sinks(self.layer_sinks(layer, device))

    @property
    def model_layers(self) -> int:
        """The model's layers (num_layers counts those the policy compresses: fewer in a hybrid model)."""
        return self.num_layers if self.layer_kinds is None else self.layer_kinds.num_layers

    @property
    def spare_entries(self) -> int:
        """Entries each head's pages keep free after its prompt (or a pruning) for its decode appends: what the
        decode schedule lets it grow by in a generation of `headroom` tokens, at most SPARE_RUN pages' worth;
        a whole page where nothing is known. A head's pages hold its entries and these, its partly filled last
        page counted (`LayerStore.build`'s `reserve`), ceil(reserve / S) = `spare_pages` pages beyond its own at
        most; two tiers get `spare_pages` whole pages each (`TieredStore.build`)."""
        return spare_entries(self.policy, self.headroom, self.page_size)

    def with_headroom(self, headroom: int) -> "Plan":
        """The same plan for a generation of `headroom` new tokens (its spare pages)."""
        return dataclasses.replace(self, headroom=headroom,
                                   spare_pages=spare_pages(self.policy, headroom, self.page_size))

    @property
    def bound(self) -> bool:
        """The backends are chosen (the plan names a device and a dtype)."""
        return self.device is not None and self.dtype is not None

    def bound_to(self, like: Tensor) -> "Plan":
        """The plan for a prompt whose tensors are like `like` (its cache's first prompt, at layer 0): itself
        when it is bound and they are its device and dtype; a plan without a device or dtype (a cache made
        from a policy and a config alone) bound to theirs (a device it names must be theirs), its backends
        chosen now, once (build_plan). A bound plan refuses tensors of another device or dtype (its kernels
        were chosen for its own): RuntimeError."""
        if self.bound and like.device == self.device and like.dtype == self.dtype:
            return self
        if self.bound and like.dtype == self.dtype and like.device.type == self.device.type \
                and self.device.index is None and self.layer_devices is None:  # "cuda": the current one
            return dataclasses.replace(self, device=like.device)
        if self.bound or (self.device is not None and like.device != self.device):
            raise RuntimeError(
                f"kvcompile: the prompt runs in {like.dtype} on {like.device}, but the cache's plan chose its kernels "
                f"for {self.dtype} on {self.device} (compile() reads them off the model; under torch.autocast the "
                "caches compile()'s forward and generate() make are planned for the autocast dtype): compile the "
                "model again after moving or casting it, or give a cache built for these tensors "
                "(KVCompileCache(policy, config) is bound to its first prompt's)")
        return self._rebuilt(like.device, like.dtype)

    def with_dtype(self, dtype: torch.dtype) -> "Plan":
        """The same plan for tensors of `dtype` (compile()'s entry under torch.autocast): the backends chosen
        for it."""
        return self if dtype == self.dtype else self._rebuilt(self.device, dtype)

    def _rebuilt(self, device, dtype: torch.dtype) -> "Plan":
        """This plan built again (build_plan) for `device` and `dtype`: its backends chosen for them."""
        return dataclasses.replace(
            build_plan(self.policy, _Dims(self), device=device, dtype=dtype, kernels=self.kernels,
                       page_size=self.page_size, headroom=self.headroom, compiled_entry=self.compiled_entry,
                       shard=self.shard, layer_devices=self.layer_devices, rope=self.rope),
            layer_kinds=self.layer_kinds, nope=self.nope, temperature=self.temperature)

    @property
    def backends(self) -> tuple:
        """The backends the plan holds (for compile.build_kernels and describe)."""
        return tuple(b for b in (self.prompt_scores, self.selection, self.prompt_merge, self.decode_attention,
                                 self.decode_step, self.chunk_attention) if b is not None)

    # the implementations' names (for describe, tests and logs; the runtime calls the backends)
    score_impl = property(lambda self: None if self.prompt_scores is None else self.prompt_scores.label)
    select_impl = property(lambda self: None if self.selection is None else self.selection.name)
    merge_impl = property(lambda self: None if self.prompt_merge is None else self.prompt_merge.name)
    decode_impl = property(lambda self: None if self.decode_attention is None else self.decode_attention.name)
    online_impl = property(lambda self: None if self.decode_step is None else self.decode_step.name)
    chunk_impl = property(lambda self: None if self.chunk_attention is None else self.chunk_attention.name)

    def state(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None,
              layer: int | None = None, seen: int | None = None) -> LayerState:
        """A layer's LayerState for the scorer, with the model's rotary frequencies where it reads them (on Llama 4
        the engine's layer `layer`'s: zeros and its temperature on a NoPE layer, else interleaved pairs), the
        model's soft-cap and the layer's learned sinks where the model has them (the scorer's attention weights are
        then the model's: scoring.attention_rows). `seen`: the positions up to the last query row (a chunk's end;
        None: the keys' count)."""
        rope = None if self.rope is None else torch.tensor(self.rope, dtype=torch.float32, device=k.device)
        sinks = None if layer is None else self.layer_sinks(layer, k.device)
        nope = self.nope is not None and self.nope[layer]
        return LayerState(q, k, v, mask, scale, torch.zeros_like(rope) if nope else rope, self.softcap, sinks,
                          interleaved=self.nope is not None and not nope,
                          temperature=self.temperature if nope else None, seen=seen)

    @property
    def storage(self):
        """The precision of the kept entries (the policy's storage part)."""
        return self.policy.storage

    def layer_device(self, layer: int) -> torch.device | None:
        """The device `layer` runs on, and its pages live on (None: not known before the first prompt)."""
        return self.device if self.layer_devices is None else self.layer_devices[layer]

    @property
    def heads(self) -> slice:
        """This process's KV heads as a slice of the model's (a contiguous block)."""
        return slice(self.kv_heads[0], self.kv_heads[-1] + 1)

    @property
    def attention_scores(self) -> bool:
        """The prompt's attention also computes the layer's scores (prompt_scores ColumnSumScores),
        when the whole prompt comes in one call; otherwise `score` runs the scorer's own pass."""
        return self.prompt_scores is not None and self.prompt_scores.in_attention

    @property
    def chunk_scores(self) -> bool:
        """A chunk's attention also computes the layer's scores (a chunk attention that gives column sums,
        a column-sum scorer, and no merge slots, which the model's attention sees but the score does not)."""
        return self.chunk_attention is not None and self.chunk_attention.column_sums and \
            self.policy.scoring.column_weights(1) is not None and not self.policy.merges

    def score(self, state: LayerState) -> Tensor:
        """The prompt scores of one layer (B, H, N), by the backend the plan chose."""
        return self.prompt_scores.score(self.policy.scoring, state)

    def merge_bias(self, counts: Tensor) -> Tensor | None:
        """The logit bias of every cache entry from its merge count (None: the policy drops)."""
        merge = self.policy.merge
        return merge.bias(counts) if merge.merges else None

    @property
    def host_syncs(self) -> dict[str, tuple[str, ...]]:
        """The named exceptions to a decode step that reads nothing back to the host (on an accelerator):
        name -> the runtime functions that read, with when and how often in the name. Every other decode
        step after the first runs on the device alone, with the same tensor shapes at each step."""
        out = {}
        grows = []
        if self.headroom > self.spare_pages * self.page_size:
            grows.append("past the headroom reserved as spare pages")
        if self.online_eviction:
            grows.append("a head whose ZSMerge budget outgrows the pages it holds after the prompt")
        if grows:
            out[f"page allocation: {'; '.join(grows)}: 2 reads per layer each time a head takes a page"] = ("append",)
        if self.prune_every:
            out[f"decode: every {self.prune_every}: the pruning step re-selects on the host (per-head "
                "lists), every n steps"] = ("_prune",)
        return out

    def host_sync_name(self, function: str) -> str:
        """The name of the exception in `host_syncs` whose host reads run in the engine's `function` (the key
        a cache counts them under, KVCompileCache.host_syncs); a page allocation the plan does not name (a
        cache made without a generation length, or decoding past its headroom) has a name of its own."""
        for name, functions in self.host_syncs.items():
            if function in functions:
                return name
        if function == "append":
            return UNRESERVED_PAGES
        raise KeyError(f"kvcompile: the plan names no host read in {function!r}")

    def describe(self) -> str:
        """One line per decision, for logs and `kvcompile run --verbose`: each implementation's backend with
        the thresholds that decide its threading, then what decoding and the prompt do."""
        unbound = "None (chosen at the first prompt: no device or dtype given)"
        lines = [f"device: {self.device}, dtype: {self.dtype}, kernels: {self.kernels}"]
        for name, backend in (("score_impl", self.prompt_scores), ("select_impl", self.selection),
                              ("merge_impl", self.prompt_merge), ("decode_impl", self.decode_attention),
                              ("online_impl", self.decode_step), ("chunk_impl", self.chunk_attention)):
            if backend is None:
                text = unbound if not self.bound else "None" + (
                    " (the merge rule's own merge)" if name == "merge_impl" and self.policy.merges else
                    "")
            else:
                text = backend.describe()
            lines.append(f"{name}: {text}")
        fields = ("running_scores", "online_eviction", "prune_every", "ring_rows", "spare_pages", "cascade",
                  "lazy_cascade", "prefill_chunk", "kv_heads", "heads_exchange", "layer_devices", "host_syncs",
                  "storage")
        lines += [f"{name}: {getattr(self, name)}" for name in fields]
        return "\n".join(lines + [f"store: {self.store.__name__}"])


@dataclass(frozen=True)
class PartScores:
    """The prompt's scores by the scorer part's own `score_prompt` (Plan.prompt_scores)."""

    label: ClassVar[str] = "part"
    in_attention: ClassVar[bool] = False

    def score(self, scorer, state: LayerState) -> Tensor:
        return scorer.score_prompt(state)

    def build(self, group: int, head_dim: int) -> None:
        """Nothing to build."""

    def describe(self) -> str:
        return "part (the scorer's own score_prompt)"


class _Dims:
    """The config fields a plan needs, from a plan (to build another one)."""

    def __init__(self, plan: Plan):
        self.num_hidden_layers = plan.num_layers
        self.num_key_value_heads = plan.num_heads
        self.head_dim = plan.head_dim
        self.attn_logit_softcapping = plan.softcap
        self.sinks = plan.sinks


UNRESERVED_PAGES = ("page allocation: past the pages reserved for the generation (a cache made without a generation "
                    "length, or decoding past its headroom): 2 reads per layer each time a head takes a page")
SPARE_RUN = 4  # pages: the most spares a head gets at once (64 tokens at the default page size)


def spare_pages(policy: Policy, headroom: int, page_size: int) -> int:
    """Spare pages per head for the tokens it stores while decoding, allocated in runs of this
    many pages right after its last page (LayerStore.append): enough for the headroom, but no more
    than the decode schedule lets a head grow between compactions, and at most SPARE_RUN
    (generate()'s max_new_tokens can be 1024 where a head keeps 128: its spares would
    outweigh what it keeps); one page when nothing is known."""
    return math.ceil(spare_entries(policy, headroom, page_size) / page_size)


def spare_entries(policy: Policy, headroom: int, page_size: int) -> int:
    """Free entries a head keeps after its prompt for the tokens it stores while decoding (Plan.spare_entries):
    what the decode schedule lets it grow by, at most SPARE_RUN pages' worth; a page's worth when nothing is
    known (no headroom, nor a schedule's bound). `spare_pages` is ceil of this over the page size."""
    decode = policy.schedule.decode
    growth = headroom if decode is None else decode.spare_growth(headroom)
    return min(growth, SPARE_RUN * page_size) if growth > 0 else page_size


# Prompt merges with a batched kernel (kernels.merge.residual_merge: the sequential rule, bit for bit);
# other merge rules run their own `merge` per head. Online eviction is vectorised for these rules.
_MERGE_KERNELS = (Residual,)
_TIERED_MERGES = (Residual,)  # slots a tiered store keeps in its high tier, with the merge bias there
_ONLINE_MERGES = (Residual, Drop)


def _resolve(op: str, requested: str | None, device, dtype, head_dim: int) -> str | None:
    from kvcompile.kernels.choice import IMPLS, resolve

    if device is None:  # chosen at the first prompt (Plan.bound_to); the name is checked now
        if requested is not None and requested not in IMPLS[op]:
            raise ValueError(f"{op}: unknown impl {requested!r}; one of {' | '.join(IMPLS[op])}")
        return None
    return resolve(op, requested, device, dtype, head_dim=head_dim)


def _quantized_decode(impl: str, device, dtype, head_dim: int, storage, tiered: bool):
    """The decode attention backend over quantized pages (kernels.paged_attention_quant) for the float
    pages' choice `impl`: the C++ kernel where it runs for the part's groups, Triton where asked (a GPU),
    else the eager reference (dequantize, then attend)."""
    from kvcompile.kernels import paged_attention_quant as quant

    group = storage.group_size(head_dim)
    key_group = storage.key_group(head_dim)
    if impl == "cpp" and quant.supports(device, dtype, head_dim, (group,)):
        codes = dataclasses.replace(quant.backend("cpp"), key_group=key_group, value_group=group)
    else:
        codes = quant.backend("triton" if impl == "triton" else "torch")
    if tiered:  # entries in the model's dtype beside the codes (kvcompile.store.tiers)
        from kvcompile.store import TieredPagedAttention

        return TieredPagedAttention(codes, high_cpp=codes.name == "cpp")  # (the C++ kernel's fp32, its head dim)
    return codes


def _explicit_decode(softcap: float | None, storage, tiered: bool):
    """The decode attention backend of a model that soft-caps its logits or has learned sinks: the eager torch
    lowering with the cap (before the merge bias) and the sinks (`with_sinks` gives a layer's), over float pages
    (kernels.paged_attention.SoftcapPagedAttention), codes (kernels.paged_attention_quant.
    SoftcapQuantPagedAttention: dequantized, then attended) or two tiers (store.SoftcapTieredPagedAttention: the
    sinks once over both); no C++ or Triton kernel applies either."""
    from kvcompile.kernels import paged_attention, paged_attention_quant

    if not storage.quantizes:
        return paged_attention.SoftcapPagedAttention(softcap or 0.0)
    codes = paged_attention_quant.SoftcapQuantPagedAttention(softcap or 0.0)
    if tiered:
        from kvcompile.store import SoftcapTieredPagedAttention

        return SoftcapTieredPagedAttention(codes, softcap=codes.softcap)
    return codes


def _quant_step_runs(policy: Policy, kernels: str | None, device, dtype, head_dim: int) -> bool:
    """A fused step of a quantized store computes this policy's decode step here: codes per token, or KIVI's keys
    per channel in two tiers (its flush, a page run at a time, inside the step), no running scores, no online
    eviction, a merge bias of the form α·log w where slots sit beside the codes (StepRule), and the quantized C++
    kernel runs for its groups (fp32 on a CPU, kernels None or "cpp"). One store of codes: kernels.append_step;
    two tiers (mixed precision, KIVI, or merge slots beside the codes): kernels.tiered_step."""
    storage = policy.storage
    if policy.scoring.running or (policy.schedule.decode is not None and policy.schedule.decode.online) \
            or (storage.key_axis != "token" and not policy.tiered) or _step_rule(policy, False) is None:
        return False
    if kernels not in (None, "cpp") or device is None or dtype is None:
        return False
    from kvcompile.kernels import paged_attention_quant as quant

    return quant.supports(device, dtype, head_dim, (storage.low().group_size(head_dim),))


def _decode_step(policy: Policy, impl: str, rule: StepRule | None, decode_impl: str, head_dim: int):
    """The decode step backend (kvcompile.kernels.online_step's family) of `impl` for this policy: the torch step
    (engine.online.TorchStep); for "cpp" the fused step of its store: store.pages.CppAppendStep for fp32
    pages of a plain step (where the paged C++ kernel runs, decode_impl "cpp") and for one store of codes,
    store.pages.CppOnlineStep for fp32 pages whose scores run or that evict (or a plain step at a head
    dim the paged kernel does not take), kernels.tiered_step.CppTieredStep for two tiers (the appending one: the
    codes where every token is codes; KIVI's flush inside it)."""
    if impl == "torch":
        from kvcompile.engine.online import TorchStep

        return TorchStep()
    from kvcompile.kernels.append_step import FLOAT
    from kvcompile.kernels.tiered_step import CppTieredStep
    from kvcompile.store.pages import CppAppendStep, CppOnlineStep

    if not policy.storage.quantizes:
        if rule.decay is None and not rule.evict and decode_impl == "cpp":
            return CppAppendStep(FLOAT, 0, alpha=rule.alpha)
        return CppOnlineStep(rule)
    codes = policy.storage.low()
    if not policy.tiered:
        return CppAppendStep(codes.bits, codes.group_size(head_dim))
    return CppTieredStep(codes.bits, codes.group_size(head_dim), rule.alpha, append_low=not policy.storage.tiered,
                         residual=policy.storage.flushes_after)


def _tiered_refusal(policy: Policy, page_size: int) -> str | None:
    """Why a policy whose entries take two precisions (Policy.tiered: a tiered storage part, or codes beside
    merge slots; kvcompile.store.tiers) cannot run."""
    storage, scoring, decode = policy.storage, policy.scoring, policy.schedule.decode
    if scoring.running:
        return (f"scoring: {scoring.name} updates every entry's score while decoding, over one pool of pages; "
                "a head's entries in two tiers have no running scores yet")
    if decode is not None and decode.online:
        return f"decode: {decode.name} evicts entries one at a time from one pool of pages, which two tiers are not"
    if policy.merges and not isinstance(policy.merge, _TIERED_MERGES):
        return f"merge: {policy.merge.name} has no slots kept beside codes (supported: residual)"
    if storage.key_axis == "channel":
        if policy.merges:
            return ("merge: residual keeps slots in the full-precision tier, whose oldest entries KIVI turns into "
                    "codes")
        if decode is not None and decode.prune_every:
            return ("decode: every re-selects a head's entries, and KIVI's groups of keys per channel are fixed "
                    "by each head's count (entries leave only by the prompt's selection)")
        if storage.tokens % page_size:
            return (f"tokens {storage.tokens} must be a multiple of the page size {page_size}: a group leaves the "
                    "full-precision pages a whole page run at a time")
    return None


def _step_rule(policy: Policy, online: bool) -> StepRule | None:
    """The fused step's numbers for this policy, or None where a part's behaviour is not of the
    form it computes (a running update other than λ·s + a, a bias other than α·log w)."""
    scoring = policy.scoring
    decay = scoring.running_decay if scoring.running else None
    alpha = policy.merge.bias_alpha if policy.merges else None
    if (scoring.running and decay is None) or (policy.merges and alpha is None):
        return None
    return StepRule(decay, scoring.gqa == "max", alpha, online)


def _head_local_hint(scoring) -> str:
    """How to make `scoring` read its own heads only, where a field of it says so."""
    return ", or score each group apart (scoring: {last_token: {heads: group}})" \
        if getattr(scoring, "heads", None) == "all" else ""


def _heads_exchange(policy: Policy, shard: HeadShard, num_heads: int) -> str:
    """What a tensor-parallel rank gathers for its selections (Plan.heads_exchange); PlanError
    for what cannot run sharded."""
    if shard.num_heads != num_heads:
        raise PlanError(f"kvcompile: the tensor-parallel shard is of {shard.num_heads} KV heads, the model has "
                        f"{num_heads}")
    if not policy.scoring.head_local:
        raise PlanError(f"kvcompile: scoring: {policy.scoring.name} reads other KV heads than the one it scores; "
                        f"under tensor parallelism a rank holds only its own heads ({policy.name} cannot run "
                        "sharded: load the model without tp_plan" + _head_local_hint(policy.scoring) + ")")
    budget = policy.budget
    if budget.threshold is not None:  # no head budgets, no layer totals: the cut alone
        return "none" if budget.threshold.head_local else "scores"
    return "counts" if budget.heads.head_local and not budget.layers.needs_scores else "scores"


def build_plan(policy: Policy, config, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
               kernels: str | None = None, page_size: int = 16, headroom: int = 0,
               compiled_entry: bool = False, shard: HeadShard | None = None,
               layer_devices: tuple[torch.device, ...] | None = None,
               rope: tuple[float, ...] | None = None, sinks: tuple | None = None) -> Plan:
    """The plan for `policy` on a model with this `config` (layers, KV heads, head dim).
    Raises PlanError for what cannot run (a kernel that does not exist here, a merge rule
    that has no online path), before anything runs.

    kernels: None (the defaults: Triton on a GPU; on a CPU the C++ decode kernel for fp32
    and the eager torch lowerings), or one name for every kernel that has it ("triton",
    "cpp", "torch", "compiled"). The prompt scorer: on a GPU the fused window-scoring kernel;
    on a CPU the scorer part's own path unless kernels="compiled" asks for the fused kernel
    through Inductor (benchmarks/bench_window_scores.py: 0.3–0.6× the part's time warm, but
    5–8 s of Inductor compile on first use and again for a new length, more than it saves
    on one 4k prompt). compiled_entry: the model runs the compiled entry; on a CPU its
    decode kernel for other dtypes than fp32 is then the Inductor-compiled lowering.
    Where scores run while decoding or tokens leave online, a decode step is one fused call
    (online_step, kernels.online_step): the C++ step for fp32 on a CPU with a compiler (or
    kernels="cpp"), else the runtime's Python path (kernels="torch", other devices and dtypes).
    A prompt compressed in chunks (schedule.prefill: chunk) runs each chunk's attention over the held
    entries and itself through the column-sums C++ kernel where it runs (CppChunkAttention: fp32 on a CPU,
    head dim a multiple of 16, kernels None or "cpp"; it also gives the scores of a column-sum scorer
    that does not merge), else through SDPA with a (T × E + T) mask; on a model that soft-caps its logits or has
    learned sinks, written out with them (ExplicitChunkAttention), as its decode attention is (`_explicit_decode`).
    rope: the rotary inverse frequencies, for a scorer that reads them (default: from `config`, rope_frequencies).
    shard: this process's share of the KV heads under tensor parallelism (kvcompile.sharding.model_shard);
    the plan names them and what its selections gather across ranks.
    layer_devices: each layer's device, for layers that run on several devices of `device`'s type
    (kvcompile.devices.execution_devices; `device` is layer 0's); None: every layer runs on `device`.
    The implementations become the plan's backends here (with a device and a dtype; else at the first
    prompt, Plan.bound_to): nothing resolves or compares an implementation name after this."""
    if page_size < 1:
        raise PlanError(f"kvcompile: page_size must be >= 1, got {page_size}")
    if headroom < 0:
        raise PlanError(f"kvcompile: headroom must be >= 0, got {headroom}")
    device = torch.device(device) if device is not None else None
    num_layers = config.num_hidden_layers
    try:
        kinds = layer_kinds(config, policy.budget.layers.kinds)
    except LayerKindError as exc:
        raise PlanError(str(exc)) from None
    if kinds is not None and layer_devices is not None and len(layer_devices) == num_layers:
        layer_devices = [d for d, i in zip(layer_devices, kinds.engine) if i is not None]  # the compressed ones'
    if kinds is not None:  # the engine runs the layers the policy compresses; the others keep their window
        num_layers = kinds.compressed
    if layer_devices is not None:
        layer_devices = tuple(torch.device(d) for d in layer_devices)
        if len(layer_devices) != num_layers or layer_devices[0] != device \
                or any(d.type != device.type for d in layer_devices):
            raise PlanError(f"kvcompile: layer_devices must name a device of {device}'s type for each of the "
                            f"{num_layers} layers, layer 0's being {device}; got {[str(d) for d in layer_devices]}")
        if len(set(layer_devices)) == 1:
            layer_devices = None
        elif shard is not None:
            raise PlanError("kvcompile: a tensor-parallel rank whose layers run on several devices; each rank "
                            "runs its layers on its own device")
    num_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scoring, decode = policy.scoring, policy.schedule.decode
    softcap = float(getattr(config, "attn_logit_softcapping", None) or 0) or None
    sinks = sinks if sinks is not None else getattr(config, "sinks", None)  # (_Dims: a plan's own)
    why = None if softcap is None else _softcap_refusal(policy)  # (learned sinks: every scorer runs with them)
    if why is not None:
        raise PlanError(f"kvcompile: model type {getattr(config, 'model_type', None)!r} soft-caps its attention "
                        f"logits (attn_logit_softcapping={softcap}: cap·tanh(s/cap) before the softmax), and {why}; "
                        "it is refused rather than run with other logits")
    explicit = softcap is not None or sinks is not None  # attention written out (engine.explicit)
    cuda = device is not None and device.type == "cuda"
    decode_kernels = kernels
    if compiled_entry and kernels is None and not cuda and dtype is not None and dtype != torch.float32:
        decode_kernels = "compiled"  # the C++ kernel is fp32 only
    bound = device is not None and dtype is not None  # else: names checked (and resolved where a device is
    #   named, for its errors), the backends chosen at the first prompt
    try:
        decode_impl = _resolve("paged_attention", decode_kernels, device, dtype, head_dim)
        # the selection / gather kernels: Triton where asked (or on a GPU), else the eager torch
        # lowering (a few sorts and a copy: nothing for Inductor to fuse)
        select_impl = _resolve("select", kernels if kernels in (None, "triton") else "torch", device, dtype,
                               head_dim)
        merge_impl, merge_compile_above = None, None
        if isinstance(policy.merge, _MERGE_KERNELS):
            merge_impl = _resolve("merge", kernels, device, dtype, head_dim)  # cpp for fp32 on the CPU
            if kernels is None and merge_impl == "torch" and not cuda:
                merge_compile_above = 2048  # a long walk: Inductor's one-time compile pays for itself
        score_impl = "part"  # (a soft-cap or sinks: the prompt's attention written out applies them; no fused kernel)
        if not explicit and scoring.fused_window() is not None and (cuda or kernels in ("triton", "compiled")):
            score_impl = _resolve("window_scores", kernels, device, dtype, head_dim)
        if not explicit and scoring.column_weights(1) is not None and device is not None \
                and kernels in (None, "cpp") \
                and _resolve("column_sums", kernels, device, dtype, head_dim) == "cpp":
            score_impl = "column_sums:cpp"  # attention and score in one pass: 0.6-0.8x the attention alone
        chunk_impl = None  # (a soft-cap or sinks: the chunk's attention written out, ExplicitChunkAttention)
        if policy.schedule.chunk_tokens and not explicit and device is not None and kernels in (None, "cpp") \
                and _resolve("column_sums", kernels, device, dtype, head_dim) == "cpp":
            chunk_impl = "cpp"  # a chunk's attention without its (T × E + T) mask, in blocks up to each query
    except ValueError as exc:
        raise PlanError(f"kvcompile: {exc}") from None
    online = decode is not None and decode.online
    if online and not isinstance(policy.merge, _ONLINE_MERGES):
        raise PlanError(f"kvcompile: decode: {decode.name} with merge: {policy.merge.name} has no online "
                        f"eviction path (supported merge rules: "
                        f"{', '.join(c.name for c in _ONLINE_MERGES)})")
    storage = policy.storage
    if storage.quantizes:
        why = storage.check_head_dim(head_dim)
        if why is not None:
            raise PlanError(f"kvcompile: storage: {storage.name}: {why}")
        if policy.tiered:
            why = _tiered_refusal(policy, page_size)
            if why is not None:
                raise PlanError(f"kvcompile: storage: {storage.name}: {why}")
    online_impl, step_rule = "torch", None  # the torch step computes every policy; a fused C++ one where it can
    if storage.quantizes:
        # codes per token (one tier, or two: codes and floats) with neither running scores nor online eviction:
        # the append and the attention over the codes (and the float tier) as one C++ call (kernels.append_step,
        # kernels.tiered_step) where the quantized C++ kernel runs; the rest take the torch step
        # (the store's append, then attention)
        if not explicit and _quant_step_runs(policy, kernels, device, dtype, head_dim):  # (else the torch step)
            online_impl, step_rule = "cpp", _step_rule(policy, False)
    elif (scoring.running or online) and not explicit:  # (a soft-cap or sinks: the Python step applies them)
        step_rule = _step_rule(policy, online)
        if step_rule is not None:
            try:
                online_impl = _resolve("online_step", kernels if kernels in ("cpp", "torch") else None, device,
                                       dtype, head_dim)
            except ValueError as exc:
                raise PlanError(f"kvcompile: {exc}") from None
    elif kernels in (None, "cpp") and device is not None and not explicit:
        # a plain decode step (append + attention) as one C++ call: the append and the paged C++ kernel
        # (kernels.append_step), or, for a head dim it does not take, the one-thread fused step: the separate
        # append and attention calls cost ~0.1 ms a layer in small torch ops, 5-10 % of a SmolLM2 step at 128
        # entries per head
        step_rule = _step_rule(policy, False)
        if step_rule is not None and _resolve("online_step", None, device, dtype, head_dim) == "cpp":
            online_impl = "cpp"
        else:
            step_rule = None
    backends = {}
    if bound:  # the names become the backends the runtime calls (kvcompile.kernels.*), once
        from kvcompile.kernels import chunk_attention, merge, paged_attention, select, window_scores
        from kvcompile.kernels.attention_column_sums import ColumnSumScores

        backends = dict(
            prompt_scores=ColumnSumScores() if score_impl == "column_sums:cpp" else PartScores()
            if score_impl == "part" else window_scores.backend(score_impl),
            selection=select.backend(select_impl, cuda=cuda),
            prompt_merge=None if merge_impl is None else merge.backend(merge_impl, merge_compile_above),
            decode_attention=_explicit_decode(softcap, storage, policy.tiered) if explicit else
            paged_attention.backend(decode_impl) if not storage.quantizes else
            _quantized_decode(decode_impl, device, dtype, head_dim, storage, policy.tiered),
            decode_step=_decode_step(policy, online_impl, step_rule, decode_impl, head_dim),
            chunk_attention=None if not policy.schedule.chunk_tokens else chunk_attention.CppChunkAttention()
            if chunk_impl == "cpp" else chunk_attention.ExplicitChunkAttention(softcap or 0.0) if explicit else
            chunk_attention.SdpaChunkAttention())
    prune_every = decode.prune_every if decode is not None else 0
    ring_rows = scoring.query_rows(2 ** 30) if prune_every and not scoring.running else 0
    exchange = "none"
    if shard is not None:
        exchange = _heads_exchange(policy, shard, num_heads)
    cascade = policy.layer_dynamic and policy.budget.threshold is None
    chunk = policy.schedule.chunk_tokens
    if chunk and shard is not None:
        raise PlanError(f"kvcompile: {policy.name} compresses while prefilling in chunks (schedule.prefill), which "
                        "does not run under tensor parallelism (its selections among held entries and chunk are "
                        "not sharded); load the model without tp_plan, or drop schedule.prefill")
    if chunk and not scoring.head_local:
        raise PlanError(f"kvcompile: {policy.name}: scoring: {scoring.name} reads every head's attention, and a "
                        "prompt compressed chunk by chunk (schedule.prefill) scores each head over the entries it "
                        "holds; drop schedule.prefill" + _head_local_hint(scoring))
    if chunk and policy.budget.layers.ranks_entries:
        raise PlanError(f"kvcompile: {policy.name}: layers: {policy.budget.layers.name} ranks every layer's entries "
                        "of the whole prompt, which a prompt compressed chunk by chunk (schedule.prefill) does not "
                        "have; drop schedule.prefill")
    nope = temperature = None
    if scoring.needs_rope and rope is None:
        compressed = range(num_layers) if kinds is None else [i for i, e in enumerate(kinds.engine) if e is not None]
        rope = rope_frequencies(config, scoring.name, compressed)
        nope, temperature = llama4_positions(config, compressed)
    # a chunked prompt re-selects every layer after each chunk: the lazy cascade's counting does not apply
    lazy = cascade and not chunk and policy.budget.heads.nested and not policy.merges and policy.budget.split is None
    return Plan(
        policy=policy, num_layers=num_layers, num_heads=num_heads, head_dim=head_dim,
        kv_heads=tuple(range(num_heads)) if shard is None else shard.heads, shard=shard,
        heads_exchange=exchange, device=device, dtype=dtype, kernels=kernels,
        compiled_entry=compiled_entry, page_size=page_size,
        headroom=headroom, prompt_scores=backends.get("prompt_scores"), selection=backends.get("selection"),
        prompt_merge=backends.get("prompt_merge"), decode_attention=backends.get("decode_attention"),
        decode_step=backends.get("decode_step"), chunk_attention=backends.get("chunk_attention"),
        step_rule=step_rule, running_scores=scoring.running, online_eviction=online,
        prune_every=prune_every, ring_rows=ring_rows, spare_pages=spare_pages(policy, headroom, page_size),
        cascade=cascade, lazy_cascade=lazy, static_totals=policy.budget.threshold is None and not cascade,
        prefill_chunk=chunk, layer_devices=layer_devices,
        rope=tuple(rope) if scoring.needs_rope else None, nope=nope, temperature=temperature, layer_kinds=kinds,
        softcap=softcap, sinks=sinks,
        store=store_class(policy))



# Rotary types whose frequencies change with the sequence length (or between short and long inputs):
# a scorer that rotates queries to future positions cannot know the ones the model will use there.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _softcap_refusal(policy: Policy) -> str | None:
    """Why `policy` cannot run exactly on a model that soft-caps its attention logits, or None (learned sinks
    refuse no policy). Every attention the plan runs applies the cap and the sinks, in eager torch where a kernel
    does not (build_plan chooses those backends once): the prompt's attention, a local layer's window and a
    chunk's attention over the held entries (engine.explicit, kernels.chunk_attention.ExplicitChunkAttention),
    the decode attention over float pages, codes or two tiers (kernels.paged_attention.SoftcapPagedAttention,
    kernels.paged_attention_quant.SoftcapQuantPagedAttention, store.SoftcapTieredPagedAttention), the torch
    decode step's (running scores, online eviction), with a merge slot's bias added after the cap; and the
    scorers' attention weights (LayerState.softcap / .sinks) and a reconstruction scorer's forwards and softmax
    (engine.reconstruction, KVzip.score_keys). Only expected attention's closed form has none under a cap."""
    scoring = policy.scoring
    if not scoring.softcaps:
        return (f"scoring: {scoring.name} scores entries by the expected attention of future queries, whose closed "
                "form (E[exp(c·qᵀk)] over a Gaussian query) has none under the cap (E[exp(cap·tanh(c·qᵀk/cap))])")
    return None


def rope_frequencies(config, scorer: str, layers) -> tuple[float, ...]:
    """The model's rotary inverse frequencies (d/2 of them), from its config as transformers computes them
    (`rope_parameters`: the default rope, or one of its ROPE_INIT_FUNCTIONS); PlanError where they are not fixed or
    not over the whole head. `layers`: the model layers the policy compresses, whose queries the scorer moves.

    Where every compressed layer uses no rotary (Llama 4's NoPE layers, no_rope_layers[i] = 0: its full_attention
    layers by default) they are d/2 zeros: the layer's map from a query to its position has no rotation,
    R(t) = I for every t (Plan.nope marks those layers where others rotate; llama4_positions)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope and not any(no_rope[i] for i in layers):
        return (0.0,) * (head_dim // 2)
    params = getattr(config, "rope_parameters", None) or {}
    if not params and getattr(config, "rope_theta", None) is not None:
        params = {"rope_type": "default", "rope_theta": config.rope_theta}
    per_kind = "full_attention" in params  # a hybrid model's rotary per layer kind (Gemma 3): the compressed
    if per_kind:  # layers are its full_attention ones (kvcompile.layer_kinds)
        params = params["full_attention"]
    kind = params.get("rope_type", "default")
    if not params or kind in _LENGTH_DEPENDENT_ROPE:
        raise PlanError(f"kvcompile: scoring: {scorer} rotates queries to future positions and needs the model's "
                        f"fixed rotary frequencies; this config has "
                        f"{'none' if not params else f'rope_type {kind!r}, whose frequencies change with length'}")
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise PlanError(f"kvcompile: scoring: {scorer} supports a rotary over the whole head only "
                        "(partial_rotary_factor = 1)")
    if kind == "default":
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv = ROPE_INIT_FUNCTIONS[kind](config, "cpu", **({"layer_type": "full_attention"} if per_kind else {}))[0]
    return tuple(float(x) for x in inv)


def llama4_positions(config, layers) -> tuple[tuple[bool, ...] | None, tuple[float, float] | None]:
    """Llama 4's map from a query to its position on the compressed model layers `layers` (Plan.nope,
    Plan.temperature): whether each is a NoPE layer (no_rope_layers[i] = 0), and the NoPE layers' temperature
    tuning (attn_scale, floor_scale) where attn_temperature_tuning is on, under which transformers scales the
    query at position p by 1 + attn_scale·log(1 + ⌊(p + 1)/floor_scale⌋) (scoring.temperature_scales); its other
    layers rotate interleaved pairs (complex multiplication, scoring.rotate_pairs). (None, None) for another
    model."""
    no_rope = getattr(config, "no_rope_layers", None)
    if not no_rope:
        return None, None
    nope = tuple(not no_rope[i] for i in layers)
    tuned = getattr(config, "attn_temperature_tuning", False) and any(nope)
    return nope, (float(config.attn_scale), float(config.floor_scale)) if tuned else None
