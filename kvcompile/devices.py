"""Where a model's layers run: the device each layer's pages live on (docs/INTERNALS.md "Several devices").

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
they are all on "meta" and no hook moves them in). `execution_devices(model)` is what compile()
plans with: the device of layer 0 (where the prompt's and the decode schedule's state starts) and,
for layers that run on several devices (a pipeline over two GPUs: `device_map="auto"` on a machine
with several), each layer's device. Each layer's pages live on its device; the state every layer
reads (the prompt's lengths, pads, layer totals, the decode budgets) follows the layer that runs
(`KVCompileCache.state_to`), and what one layer reads of another (a cascade's re-selection of lower
layers, the pages the layers above hold) is moved to where it is read. Layers on devices of different
types (a hook that runs some layers on the CPU next to a GPU) are refused: the plan chooses one set of
kernels for one device type (accelerate itself never does this: a device_map that maps layers to
"cpu" next to a GPU offloads them, and runs them on the GPU).
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


def execution_devices(model) -> tuple[torch.device | None, tuple[torch.device, ...] | None]:
    """(device, per_layer): the device layer 0 runs on (None when it is not known before the first
    prompt: weights on "meta" and no hook), and each layer's device when they run on several (else
    None). DeviceError for layers on "meta", on devices of several types, or some on a known device
    and others on none."""
    devices = layer_devices(model)
    known = {d for d in devices if d is not None}
    if any(d.type == "meta" for d in known):
        raise DeviceError("kvcompile: the model's layers run on the 'meta' device (no weights): load or dispatch "
                          "it onto a real device first")
    if len(known) <= 1:
        return next(iter(known), None), None
    spread = "; ".join(f"{d}: layers {_ranges(layers)}" for d, layers in _by_device(devices).items())
    if len({d.type for d in known}) > 1:
        raise DeviceError(
            f"kvcompile: the model's layers run on devices of several types ({spread}); the plan chooses one set "
            "of kernels for one device type. accelerate runs layers that a device_map puts on 'cpu' or 'disk' "
            "next to a GPU on that GPU (their weights streamed in): dispatch the model that way, or onto one type")
    if None in devices:
        raise DeviceError(f"kvcompile: some layers have no device ({spread}; None: weights on 'meta' and no "
                          "accelerate hook); dispatch every layer")
    return devices[0], devices


def _by_device(devices) -> dict[str, list[int]]:
    where: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        where.setdefault(str(d), []).append(i)
    return where


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs = []
    for i in layers:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
