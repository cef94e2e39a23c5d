"""Where a model's layers run: the device each layer's pages live on (DESIGN.md §8 "Several devices").

A model dispatched by accelerate (`from_pretrained(..., device_map=...)`, `dispatch_model`,
`cpu_offload`, `disk_offload`) may keep some weights on the "meta" device, in CPU memory or on
disk; accelerate's hooks (`AlignDevicesHook`) move them onto the module's *execution device*
when it runs, and move its inputs there. A layer's attention, so kvcompile's op and that
layer's pages, run on the execution device of the layer's attention module, not on the device
its weights are stored on: with `device_map={"model.layers.0": 0, "model.layers.1": "cpu", ...}`
accelerate runs the CPU-held layers on GPU 0 (weights streamed in, `dispatch_model`'s main
device), and their pages live there.

`layer_devices(model)` reads, per decoder layer, the execution device of accelerate's hook on its
k_proj (where the keys are computed), else of the nearest hook on its attention module or an
ancestor, else the device of its own parameters (None where
they are all on "meta" and no hook moves them in). `execution_device(model)` is the one device
the cache lives on; layers that run on several devices (a pipeline over two GPUs, a hook that
runs some layers on the CPU and others on a GPU) are refused before anything runs: the cache's
prompt and decode state (lengths, pads, layer totals, per-head budgets) and a cascade's
re-selection of lower layers are shared by every layer, on one device.
"""
from __future__ import annotations

import torch


class DeviceError(ValueError):
    """The model's layers run on devices kvcompile cannot serve as they are (said before anything runs)."""


def _hook_device(module) -> torch.device | None:
    """The execution device of accelerate's hook on `module` (an AlignDevicesHook, possibly inside a
    SequentialHook), or None when it has none or its hook names none."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    for h in hooks:
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    return None


def _param_device(module) -> torch.device | None:
    devices = {p.device for p in module.parameters() if p.device.type != "meta"}
    if len(devices) == 1:
        return next(iter(devices))
    return None


def has_hooks(model) -> bool:
    """Whether accelerate hooks sit on the model or any of its modules (dispatch, offload)."""
    return any(hasattr(m, "_hf_hook") for m in model.modules())


def layer_devices(model) -> tuple[torch.device | None, ...]:
    """The device each decoder layer's attention runs on (see the module docstring)."""
    parents: dict[int, object] = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        # the keys come out of k_proj: its hook's device (cpu_offload hooks the modules that hold
        # weights), else the nearest hook on the attention module or above (dispatch_model's per-block hooks)
        proj = getattr(attn, "k_proj", None)
        device = _hook_device(proj) if proj is not None else None
        module = attn
        while module is not None and device is None:
            device = _hook_device(module)
            module = parents.get(id(module))
        out.append(device if device is not None else _param_device(attn))
    return tuple(out)


def execution_device(model) -> torch.device | None:
    """The one device every layer's attention, and so every layer's pages, live on; None when it is
    not known before the first prompt (weights on "meta" and no hook). DeviceError for layers that
    run on several devices."""
    devices = layer_devices(model)
    known = {d for d in devices if d is not None}
    if len(known) > 1:
        where = {}
        for i, d in enumerate(devices):
            where.setdefault(str(d), []).append(i)
        spread = "; ".join(f"{d}: layers {_ranges(layers)}" for d, layers in where.items())
        raise DeviceError(
            f"kvcompile: the model's layers run on several devices ({spread}); a KVCompileCache keeps the "
            "prompt's and the decode schedule's state (lengths, pads, layer totals, head budgets) for every "
            "layer on one device, and a cascade re-selects lower layers from a later layer's step, so every "
            "layer must run on one device. Weights may live anywhere: a device_map that maps layers to 'cpu' "
            "or 'disk' (offload_folder) next to one GPU runs them on that GPU, and their pages live there")
    if any(d is not None and d.type == "meta" for d in known):
        raise DeviceError("kvcompile: the model's layers run on the 'meta' device (no weights): load or dispatch "
                          "it onto a real device first")
    return next(iter(known)) if known else None


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs = []
    for i in layers:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
