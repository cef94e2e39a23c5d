"""Every Triton kernel of kvcompile compiled for real NVIDIA targets on a machine without a GPU.

Triton's compiler takes an explicit target (`triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))`) and runs ptxas, which ships with Triton, so PTX and
a cubin come out on any machine. What gets compiled is taken from the launch functions
themselves, not restated here: each launch function (`paged_attention_triton`,
`window_scores_triton`, ...) is called on CPU tensors of an 8B-class GQA model's shapes
while a stand-in driver reports the target, and Triton's `jit_cache_hook` records every
kernel launch (signature, constexprs, pointer alignment, num_warps, num_stages) exactly
as the JIT specialises it, and skips the launch. Each recorded kernel is then compiled
for the target and its cubin read by `cuobjdump --dump-resource-usage` (registers,
static shared memory, stack, local memory) and `ptxas -v` (spill stores and loads);
Triton's metadata gives the dynamic shared memory the launch asks for.

Triton decides at decoration time whether kernels run in its interpreter
(TRITON_INTERPRET=1, as tests/conftest.py sets), so this runs in a process where it is
unset: `python -m kvcompile.kernels.targets --arch 90` prints the rows as JSON
(scripts/triton_targets.py runs one such process per target and prints a table).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

# Shared memory one block may use, in bytes (the opt-in maximum per block: CUDA C
# Programming Guide, "Compute Capabilities", table of technical specifications).
SHARED_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024}
ARCHS = (80, 90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Model:
    """The shapes the kernels are compiled at: an 8B-class GQA model (Llama-3-8B's
    attention: 32 layers, 32 query heads over 8 KV heads, head dim 128) with kvcompile's
    default page of 16 entries, a 4096-token prompt and the shipped specs' settings
    (128 entries per head, observation windows of 32 and 8, pooling kernels 7 and 5,
    ZSMerge's 9 % residual share of 128 = 12 slots)."""
    layers: int = 32
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    page: int = 16
    prompt: int = 4096
    per_head: int = 128
    residual_slots: int = 12


@dataclasses.dataclass
class Launch:
    """One kernel launch as Triton's JIT specialised it."""
    case: str
    kernel: str
    fn: object
    signature: dict
    constants: dict
    attrs: dict
    options: dict
    key: str


class _TargetDriver:
    """Stands in for the CUDA driver: reports the target; device 0 and stream 0."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _cases(model: Model, dtype: torch.dtype):
    """(case name, a call of a launch function) at the model's shapes, one per variant a
    shipped spec selects (bias or not, pooling, GQA reduction, value weight, pooled budgets)."""
    from kvcompile.kernels import merge, paged_attention, paged_attention_quant, select, window_scores

    b, h, hq, d, s, n = 1, model.kv_heads, model.q_heads, model.head_dim, model.page, model.prompt
    pages = -(-n // s)
    pool = b * h * pages + 4

    def paged(bias: bool):
        q = torch.zeros(b, hq, d, dtype=dtype)
        k = torch.zeros(pool, s, d, dtype=dtype)
        table = torch.zeros(b, h, pages, dtype=torch.int32)
        lengths = torch.full((b, h), n, dtype=torch.int32)
        bias_pages = torch.zeros(pool, s) if bias else None
        return lambda: paged_attention.paged_attention_triton(q, k, k, table, lengths, bias_pages)

    def window(window: int, pooling: str, kernel: int, gqa: str, value_weight: bool):
        q = torch.zeros(b, hq, window, d, dtype=dtype)
        k = torch.zeros(b, h, n, d, dtype=dtype)
        mask = torch.ones(b, n, dtype=torch.bool)
        return lambda: window_scores.window_scores_triton(
            q, k, k, mask, None, window=window, gqa=gqa, pooling=pooling, kernel=kernel,
            value_weight=value_weight)

    def residual():
        slots = model.residual_slots
        sk = torch.zeros(b, h, slots, d, dtype=dtype)
        keys = torch.zeros(b, h, n, d, dtype=dtype)
        num = torch.full((b, h), n, dtype=torch.long)
        counts = torch.zeros(b, h, slots, dtype=torch.long)
        return lambda: merge.residual_merge_triton(sk, sk, counts, keys, keys, num,
                                                   torch.full((b, h), slots))

    ranks = torch.zeros(b, h, n, dtype=torch.long)
    flags = torch.zeros(b, h, n, dtype=torch.bool)
    budget = torch.full((b, h), model.per_head)
    scores = torch.zeros(b, h, n)

    def gather():
        keys = torch.zeros(b, h, n, d, dtype=dtype)
        kp = torch.zeros(pool, s, d, dtype=dtype)
        sp = torch.zeros(pool, s)
        pp = torch.zeros(pool, s, dtype=torch.long)
        table = torch.zeros(b, h, pages, dtype=torch.int32)
        start = torch.zeros(b, h, dtype=torch.long)
        return lambda: select.gather_pages_triton(kp, kp, sp, pp, sp, table, start, keys, keys,
                                                  scores, ranks, scores, flags)

    return [
        ("decode", paged(False)),
        ("decode, merge bias (zsmerge)", paged(True)),
        ("window 32, max pool 7, gqa max, value weight (lava)", window(32, "max", 7, "max", True)),
        ("window 32, avg pool 5, gqa mean (snapkv)", window(32, "avg", 5, "mean", False)),
        ("window 8, max pool 7, gqa mean (pyramidkv)", window(8, "max", 7, "mean", False)),
        ("residual merge, 12 slots (zsmerge)", residual()),
        ("keep best per head", lambda: select.keep_best_triton(ranks, flags, flags, budget)),
        ("keep best pooled (adakv, lava)", lambda: select.keep_best_triton(ranks, flags, flags, budget.sum(-1), True)),
        ("keep threshold (dbudgetkv)", lambda: select.keep_threshold_triton(ranks, flags, flags, scores, 0.01)),
        ("gather pages", gather()),
        *paged_attention_quant.target_cases(model, dtype),  # decode over int8 / int4 pages (storage parts)
    ]


def launches(arch: int, dtype: torch.dtype, model: Model = Model()) -> list[Launch]:
    """Every distinct kernel launch the launch functions make at the model's shapes."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    if knobs.runtime.interpret:
        raise RuntimeError("kvcompile.kernels.targets: TRITON_INTERPRET is set, so the kernels were "
                           "made for the interpreter; run in a process without it")
    seen: dict[str, Launch] = {}
    case_name = [""]

    def record(*, key, fn, compile, **_):
        if key not in seen:
            seen[key] = Launch(case_name[0], fn.name, fn.jit_function, compile["signature"],
                               compile["constants"], compile["configs"][0],
                               {k: compile[k] for k in ("num_warps", "num_ctas", "num_stages",
                                                        "enable_fp_fusion")}, key)
        return True  # skip the compile and the launch

    driver.set_active(_TargetDriver(GPUTarget("cuda", arch, 32)))
    knobs.runtime.jit_cache_hook = record
    try:
        for name, call in _cases(model, dtype):
            case_name[0] = name
            call()
    finally:
        knobs.runtime.jit_cache_hook = None
        driver.set_active(None)  # back to the default driver, created when next asked for
    return list(seen.values())


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else 0


def usage(launch: Launch, arch: int) -> dict:
    """Compile one launch for sm_<arch>: registers, shared memory, stack, local, spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    from triton.compiler import ASTSource

    row = {"kernel": launch.kernel, "case": launch.case, "arch": f"sm_{arch}",
           "num_warps": launch.options["num_warps"], "num_stages": launch.options["num_stages"],
           "constexprs": {launch.fn.arg_names[k[0]]: v for k, v in launch.constants.items()}}
    try:
        compiled = triton.compile(ASTSource(launch.fn, launch.signature, launch.constants, launch.attrs),
                                  target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    except Exception as error:  # reported as a row: the test fails on it
        return row | {"error": f"{type(error).__name__}: {error}"[:2000]}
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        resources = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin],
                                   capture_output=True, text=True, check=True).stdout
        # ptxas -v as Triton runs it (make_cubin), for the spill counts.
        fmad = [] if launch.options["enable_fp_fusion"] else ["--fmad=false"]
        log = subprocess.run([get_ptxas(arch).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", ptx,
                              "-o", os.path.join(tmp, "v.o")],
                             capture_output=True, text=True)
        if log.returncode:
            raise RuntimeError(f"ptxas -v failed on {launch.kernel}: {log.stderr[-2000:]}")
        log = log.stderr
    static = _number(r"SHARED:(\d+)", resources)
    return row | {
        "registers": _number(r"REG:(\d+)", resources),
        "stack": _number(r"STACK:(\d+)", resources),
        "local": _number(r"LOCAL:(\d+)", resources),
        "spill_stores": _number(r"(\d+) bytes spill stores", log),
        "spill_loads": _number(r"(\d+) bytes spill loads", log),
        "shared_dynamic": int(compiled.metadata.shared),
        "shared_static": static,
        "shared": int(compiled.metadata.shared) + static,
        "shared_limit": SHARED_PER_BLOCK[arch],
    }


def report(arch: int, dtypes=tuple(DTYPES), model: Model = Model()) -> list[dict]:
    """One row per distinct kernel launch and dtype, compiled for sm_<arch>."""
    rows = []
    for name in dtypes:
        for launch in launches(arch, DTYPES[name], model):
            rows.append(usage(launch, arch) | {"dtype": name})
    return rows


def run_report(arch: int, dtypes=tuple(DTYPES), timeout: float = 600) -> list[dict]:
    """`report` in a fresh process without TRITON_INTERPRET (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said explicitly
    # The child imports the same kvcompile as this process (a worktree, not the installed one).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kvcompile/kernels/ -> root
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    done = subprocess.run([sys.executable, "-m", "kvcompile.kernels.targets", "--arch", str(arch),
                           "--dtypes", *dtypes], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"compiling for sm_{arch} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, choices=ARCHS, required=True)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    args = parser.parse_args(argv)
    json.dump(report(args.arch, tuple(args.dtypes)), sys.stdout)


if __name__ == "__main__":
    main()
