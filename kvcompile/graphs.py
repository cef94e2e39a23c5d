"""Decode steps replayed from CUDA graphs: `kvcompile.compile(model, spec, mode="reduce-overhead")`.

What gpt-fast gets from torch.compile's "reduce-overhead" and vLLM from its CUDA-graph runner: a small-batch
decode step on a GPU is bound by Python and kernel launches, not by memory, unless its kernels are recorded
once in a CUDA graph and replayed. A graph replays kernels only: the Python of the step (the op's body, its
host bookkeeping) does not run. So a step can be replayed only where it is a pure function of device tensors
that keep their storage, which KVCompileCache says of its next step (`host_step()` None: the decode state
on the device, positions from its length counter, pages for the generation reserved up front); after a
replay the cache does the step's host bookkeeping itself (`replayed()`: its length, the room left in the
pages, the op's declared write). A step that needs the host (the first, which sets up the decode state; one
of the plan's named exceptions, Plan.host_syncs: a page allocation past the reserved pages, a `decode:
every` pruning) runs as without graphs, and is counted (`DecodeGraphs.eager`, by reason; the cache counts
the host reads themselves, KVCompileCache.host_syncs).

The step recorded is the compiled entry's forward for one token (the Inductor graphs around the op, the
op's decode kernels), called with the token, its positions and cache position copied into static buffers;
generate()'s 2-D attention mask, which grows every step, is not an input (a decode step reads no mask: pads
are never stored). A graph is recorded for one cache's tensors (their storage, `decode_tensors()`): the
first capturable step on new tensors (a new cache, or a layer rebuilt by a pruning or a page allocation)
runs without a graph, as warm-up (kernels compiled, dynamo's guards settled), and the next one is
recorded, then replayed. tests/test_decode_graph.py proves on the CPU that such a step replays exactly
(an FX graph of aten ops, traced by make_fx, replayed against eager steps for every spec);
tests/test_gpu.py runs this on CUDA against the eager entry's tokens.
"""
from __future__ import annotations

import threading
import weakref
from collections import Counter

import torch

from kvcompile import cache as cache_arg

# forward() arguments a recorded step takes: the token, its position and cache position (static buffers), and
# these, fixed for a decode step; any other argument given (inputs_embeds, output_hidden_states, ...) runs the
# call without a graph
STEP_ARGUMENTS = frozenset({"attention_mask", "position_ids", "cache_position", "use_cache", "return_dict",
                            "logits_to_keep", "kvcompile_cache"})


def refusal(plan) -> str | None:
    """Why a plan's decode steps cannot be replayed from CUDA graphs, or None."""
    if plan.device is None or plan.device.type != "cuda":
        where = "no device known yet" if plan.device is None else f"the model is on {plan.device}"
        return (f"mode='reduce-overhead' replays decode steps as CUDA graphs, which needs a CUDA device ({where}): "
                "here mode must be 'eager' or 'compiled'")
    if plan.layer_devices is not None:
        return ("mode='reduce-overhead': the layers run on several devices (a pipeline), and one CUDA graph records "
                "one device's stream; compile with mode='compiled'")
    if plan.shard is not None:
        return ("mode='reduce-overhead': a tensor-parallel rank's step gathers over the group (collectives are not "
                "recorded here); compile with mode='compiled'")
    if plan.layer_kinds is not None:
        return ("mode='reduce-overhead': a hybrid model's local layers hold their last window - 1 positions in "
                "tensors made afresh at every step (what left the window is freed), which a replayed graph would "
                "not write; compile with mode='compiled'")
    if plan.prune_every == 1:
        return ("mode='reduce-overhead': the policy prunes after every token (decode: every 1), a step that "
                "re-selects on the host (Plan.host_syncs), so no decode step is left to replay; compile with "
                "mode='compiled'")
    return None


def record_cuda(run, buffers: list, tensors: list):
    """Record `run(*buffers)` (a decode step's forward) in a CUDA graph: its Python runs once, doing the step's
    host bookkeeping, its kernels are recorded, not run; then replayed once, which is this step. Returns this
    step's logits and the replay (a function giving the next step's logits, in the same static tensor)."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        logits = run(*buffers).logits
    graph.replay()

    def replay():
        graph.replay()
        return logits
    return logits, replay


class DecodeGraphs:
    """A compiled model's recorded decode step (compile() puts one on its forward entry, `Entry.graphs`).

    `replays`: steps replayed; `captures`: graphs recorded; `eager`: steps that ran without a graph, by reason
    (the cache's `host_step()`, "warm-up" for the first capturable step on new tensors). One graph at a time:
    a step on other tensors (another cache) records a new one, and the old one's memory pool is freed.
    `record`: how a step is recorded (`record_cuda`; tests/test_decode_graph.py records an FX graph of aten
    ops on the CPU with the same signature), for tensors on `device_type`. Calls on several threads take
    turns (one lock: the static buffers and the graph are shared); a deep copy of the model gets its own,
    empty."""

    def __init__(self, record=record_cuda, device_type: str = "cuda"):
        self.record, self.device_type = record, device_type
        self.replays = self.captures = 0
        self.eager: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._reset()

    def __deepcopy__(self, memo):
        return DecodeGraphs(self.record, self.device_type)

    def _reset(self):
        self.replay = self.buffers = self.key = self.cache = None
        self.warm = None  # the key of the tensors the last warm-up step ran on

    def __call__(self, forward, cache, args: tuple, kwargs: dict):
        """The model's output for this call from a graph, or None: the call runs as without graphs."""
        step = self._inputs(cache, args, kwargs)
        if step is None:
            return None
        with self.lock:
            return self._step(forward, cache, step, kwargs)

    def _step(self, forward, cache, step, kwargs: dict):
        reason = cache.host_step(1)
        if reason is not None:
            self.eager[reason] += 1
            return None
        key = (id(cache), tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in cache.decode_tensors()),
               tuple(step[0].shape))
        alive = self.cache is not None and self.cache() is cache
        if self.replay is not None and key == self.key and alive:
            for buffer, value in zip(self.buffers, step):
                buffer.copy_(value)
            logits = self.replay()
            cache.replayed(1)
            self.replays += 1
            return self._output(cache, logits)
        if key != self.warm:  # new tensors: this step runs without a graph first, called as the recorded one will be
            self.warm = key
            self.eager["warm-up"] += 1
            return self._output(cache, self._recordable(forward, cache, kwargs)(*step).logits)
        return self._output(cache, self._capture(forward, cache, step, kwargs, key))

    def _inputs(self, cache, args: tuple, kwargs: dict):
        """(token ids (B, 1), position ids (B, 1), cache position (1,)) of a decode call that a graph may record,
        else None."""
        ids = args[0] if args else kwargs.get("input_ids")
        if len(args) > 1 or ids is None or ids.dim() != 2 or ids.shape[1] != 1 or ids.device.type != self.device_type \
                or torch.is_grad_enabled() or not cache.is_initialized:
            return None
        if any(value is not None for name, value in kwargs.items() if name not in STEP_ARGUMENTS | {"input_ids"}):
            return None
        if kwargs.get("return_dict") is False or kwargs.get("use_cache") is False:
            return None
        positions = kwargs.get("position_ids")
        if positions is None or positions.shape != ids.shape:
            return None
        where = kwargs.get("cache_position")
        if where is None:
            where = torch.tensor([cache.seq_length], device=ids.device)
        return ids, positions, where.reshape(1)

    @staticmethod
    def _recordable(forward, cache, kwargs: dict):
        """The step as a graph records it: the token, its positions and cache position, no mask. The warm-up step
        runs it too, so that whatever the call compiles (dynamo's graphs, Inductor's autotuned kernels) is
        compiled before the capture: autotuning synchronises the device, which a capture refuses."""
        extra = {name: kwargs[name] for name in ("logits_to_keep", "kvcompile_cache") if name in kwargs}

        def run(ids, positions, where, *tensors):
            return forward(ids, position_ids=positions, cache_position=where, **cache_arg.given(cache), use_cache=True,
                           **extra)
        return run

    def _capture(self, forward, cache, step, kwargs: dict, key):
        """Record this step in static buffers (`record`), which also runs it: its logits."""
        self._reset()
        buffers = [x.clone() for x in step]
        logits, self.replay = self.record(self._recordable(forward, cache, kwargs), buffers, cache.decode_tensors())
        self.buffers, self.key, self.cache = buffers, key, weakref.ref(cache)
        self.captures += 1
        return logits

    @staticmethod
    def _output(cache, logits):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        # a copy: the recorded step writes the next step's logits into the same tensor
        return CausalLMOutputWithPast(logits=logits.clone(), **cache_arg.given(cache))  # the field 5.24 renamed
