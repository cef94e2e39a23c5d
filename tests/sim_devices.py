"""Simulated devices for tests: `sim:0`, `sim:1`, ... behave as separate accelerators (CUDA's rules) on
this CPU, so a model whose layers run on several devices (accelerate's device_map over two GPUs) can
be tested where torch has one device (`cpu:1` is `cpu`).

A tensor on `sim:i` is a `SimTensor`: a wrapper subclass (torch's PrivateUse1 device type, renamed
"sim") around a CPU tensor. Every aten op on it runs on the CPU tensors it wraps and its result lives on
the same sim device, with the rule every accelerator enforces: an op's tensors must all be on one device
(0-dim CPU tensors aside, as on CUDA), else RuntimeError "Expected all tensors to be on the same
device". `copy_` and `.to(device)` move between devices. A custom op (torch.library.custom_op, such as
`kvcompile::attend`) runs its own Python body on the SimTensors, as it would run on GPU tensors, so
what it creates and reads is checked too.

`register()` registers the PrivateUse1 backend, renamed "sim", for the whole process (torch allows
that once, and torch.get_device_module() and torch.accelerator then name it, which transformers'
continuous batching reads): call it only in a process of its own, as tests/sim_pipeline.py does in the
process tests/test_devices.py starts for it. torch's Python-backend hook is
`torch.utils.backend_registration._setup_privateuseone_for_python_backend` (experimental: if a
later torch drops it, `available()` says so, registering nothing, and the tests skip with that reason).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_flatten, tree_map

NAME = "sim"
DEVICES = 4


class SimTensor(torch.Tensor):
    """A tensor on a simulated device: `elem`, the CPU tensor holding its data (views and in-place
    ops act on `elem`, so they alias as on a real device)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=device, requires_grad=False)
        t.elem = elem
        return t

    def __repr__(self, **kwargs):
        return f"SimTensor({self.elem!r}, device='{self.device}')"

    def tolist(self):  # torch refuses tolist() on subclasses; a device-to-host copy on a real device
        if RECORDER is not None:
            RECORDER.read("tolist", self)
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run_op(func, args, kwargs or {})


def _leaves(tree, out: list) -> list:
    """`tree`'s leaves appended to `out`: torch's tree_flatten for the plain tuples, lists and dicts an aten op
    takes and returns, without its cost per node (several times the op's own on these small tensors); any other
    container goes to tree_flatten."""
    kind = type(tree)
    if kind is tuple or kind is list:
        for x in tree:
            _leaves(x, out)
    elif kind is dict:
        for x in tree.values():
            _leaves(x, out)
    elif isinstance(tree, (tuple, list, dict)):
        out.extend(tree_flatten(tree)[0])
    else:
        out.append(tree)
    return out


def _map(fn, tree):
    """torch's tree_map(fn, tree), fast for plain tuples, lists and dicts (as `_leaves`)."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return kind(_map(fn, x) for x in tree)
    if kind is dict:
        return {k: _map(fn, x) for k, x in tree.items()}
    if isinstance(tree, (tuple, list, dict)):
        return tree_map(fn, tree)
    return fn(tree)


def _devices(flat) -> set[torch.device]:
    """The devices of an op's tensors (`flat`: its arguments' leaves), without the 0-dim CPU tensors every
    accelerator accepts."""
    return {t.device for t in flat if isinstance(t, torch.Tensor)
            and (isinstance(t, SimTensor) or t.device.type != "cpu" or t.dim() > 0)}


def _describe(args) -> str:
    return ", ".join(f"{t.device} {tuple(t.shape)}" for t in args if isinstance(t, torch.Tensor))


def run_op(func, args, kwargs):
    """One op on simulated devices (the dispatch of SimTensor and the sim backend's kernels)."""
    if func.namespace not in ("aten", "prims"):
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(func)
        if opdef is not None:  # its Python body, on the SimTensors themselves
            return opdef._init_fn(*args, **kwargs)
    unwrap = lambda t: t.elem if isinstance(t, SimTensor) else t  # noqa: E731
    if RECORDER is not None:
        RECORDER.op(func, args, kwargs)
    if func is torch.ops.aten.copy_.default:  # copies go across devices
        unwrap(args[0]).copy_(unwrap(args[1]))
        return args[0]
    target = kwargs.get("device")
    flat = _leaves((args, kwargs), [])
    if func is torch.ops.aten._to_copy.default and target is not None:
        devices = set()
    else:
        devices = _devices(flat)
    if len(devices) > 1:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{', '.join(sorted(map(str, devices)))}! (when running {func} on {_describe(args)})")
    target = torch.device(target) if target is not None else next(iter(devices), torch.device("cpu"))
    kwargs = _map(unwrap, kwargs)
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    out = func(*_map(unwrap, args), **kwargs)
    written = [t for t in flat if isinstance(t, SimTensor) and t.shape != t.elem.shape]
    if written:  # an out= tensor resized by the op: its wrapper cannot follow
        raise NotImplementedError(f"simulated devices: {func} resized its out= tensor; register its factory "
                                  "with the sim backend (sim_devices._register)")
    if target.type != NAME:
        return out
    returns = func._schema.returns
    if returns and returns[0].alias_info is not None and returns[0].alias_info.is_write \
            and args and isinstance(args[0], SimTensor):
        return args[0]  # an in-place op returns its input
    wrap = lambda t: SimTensor(t, target) if type(t) is torch.Tensor else t  # noqa: E731
    return _map(wrap, out)


# --- what a decode step reads back to the host, and the shapes it runs on --------------------------------

# ops whose result the host reads (a real device waits for its queue): a scalar, or a size known only there
HOST_READS = {"aten._local_scalar_dense.default": "item", "aten.item.default": "item",
              "aten.is_nonzero.default": "item", "aten.nonzero.default": "nonzero",
              "aten.nonzero_static.default": None, "aten.masked_select.default": "masked_select",
              "aten.unique_consecutive.default": "unique", "aten._unique2.default": "unique"}


class HostReads:
    """Records, per step (`step()` starts the next), every device-to-host read on sim tensors: item(),
    int(), bool(), float() (aten._local_scalar_dense), tolist(), nonzero, masked_select and boolean-mask
    indexing (its size is known only on the host), and copies of a sim tensor to the CPU (`copy_`,
    `.to("cpu")`, `.cpu()`); and the shapes of every op's sim tensors, in order. Install it with
    `recording()`. Each read is (kind, the innermost kvcompile frame, inside, the kvcompile functions on
    the stack): `inside` is True while the caller's `scope()` block runs (e.g. kvcompile's attend op); shapes are recorded inside it only."""

    def __init__(self):
        self.reads: list[list[tuple]] = [[]]
        self.shapes: list[list[tuple]] = [[]]
        self.inside = False

    @contextmanager
    def scope(self):
        self.inside, before = True, self.inside
        try:
            yield
        finally:
            self.inside = before

    def step(self) -> None:
        self.reads.append([])
        self.shapes.append([])

    def read(self, kind: str, t=None) -> None:
        # kvcompile's frames on the stack above the caller, innermost first (the frames themselves: what
        # traceback.extract_stack gives, without reading each file's source lines)
        frames = []
        frame = sys._getframe(2)
        while frame is not None:
            file = frame.f_code.co_filename
            if "kvcompile" in file and "sim_devices" not in file:
                frames.append((file, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        at = f"{frames[0][0].rsplit('/', 1)[-1]}:{frames[0][1]} {frames[0][2]}" if frames else "?"
        self.reads[-1].append((kind, at, self.inside, frozenset(name for _, _, name in frames)))

    def op(self, func, args, kwargs) -> None:
        name = str(func)
        if self.inside:
            flat = _leaves((args, kwargs), [])
            self.shapes[-1].append((name, tuple(tuple(t.shape) for t in flat if isinstance(t, SimTensor))))
        kind = HOST_READS.get(name, "")
        if kind:
            self.read(kind)
        elif name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default", "aten._index_put_impl_.default"):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _leaves(args[1], [])):
                self.read("boolean mask index")
        elif name in ("aten.copy_.default", "aten._copy_from.default"):
            if isinstance(args[1], SimTensor) and not isinstance(args[0], SimTensor):
                self.read("copy to cpu")
        elif name == "aten._to_copy.default":
            target = kwargs.get("device")
            if isinstance(args[0], SimTensor) and target is not None and torch.device(target).type == "cpu":
                self.read("to cpu")


RECORDER: HostReads | None = None


class recording:
    """`with recording() as rec:` installs a HostReads for the block (one at a time)."""

    def __enter__(self) -> HostReads:
        global RECORDER
        RECORDER = HostReads()
        return RECORDER

    def __exit__(self, *exc):
        global RECORDER
        RECORDER = None


def available() -> str | None:
    """None when simulated devices work here, else why not (a skip reason). Registers nothing."""
    from torch.utils import backend_registration

    if not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"):
        return f"torch {torch.__version__} has no Python backend for PrivateUse1 (simulated devices)"
    return None


def register() -> None:
    """Register the sim devices for this process (once; see the module docstring: a process of its own)."""
    from torch.utils import backend_registration

    if torch._C._get_privateuse1_backend_name() == NAME:
        return

    class Module(backend_registration._DummyBackendModule):
        def device_count(self) -> int:
            return DEVICES

    backend_registration._setup_privateuseone_for_python_backend(rename=NAME, backend_module=Module())
    # the ops that reach the backend itself (Python dispatch excluded: torch.tensor(..., device=...), .to())
    lib = torch.library.Library("aten", "IMPL")
    # and the factories whose composite writes into an empty tensor it resizes (a wrapper cannot be resized)
    for name in ("empty_strided", "empty.memory_format", "copy_", "_copy_from", "_copy_from_and_resize",
                 "_to_copy", "_local_scalar_dense", "arange", "arange.start", "arange.start_step", "eye",
                 "eye.m", "linspace", "randperm", "randint", "randint.low", "tril_indices", "triu_indices"):
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        lib.impl(name, (lambda op: lambda *args, **kwargs: run_op(op, args, kwargs))(op), "PrivateUse1")
    _LIBS.append(lib)


_LIBS: list = []  # the registrations live as long as the process
