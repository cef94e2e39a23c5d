"""The vLLM environment the vLLM tests run their subprocesses in (docs/VLLM.md: `bash scripts/setup.sh vllm`
makes .venv-vllm; VLLM_VENV names another): its Python, the embedded model, the mark that skips a test where the
environment is not set up, and the environment variables of a run (the plugin's settings cleared, then the ones
given; one thread; this checkout's kvcompile and tests/ importable, whichever checkout the environment's editable
kvcompile was installed from)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
PYTHON = VENV / "bin" / "python"
MODEL = ROOT / "models" / "smollm2-135m"
needs_vllm = pytest.mark.skipif(not PYTHON.exists(),
                                reason="the vLLM environment is not set up: bash scripts/setup.sh vllm")


def vllm_env(**plugin) -> dict:
    """The environment of a vLLM run: this process's, without its KVCOMPILE_VLLM_* settings, then `plugin`'s
    (spec="snapkv" -> KVCOMPILE_VLLM_SPEC=snapkv)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMPILE_VLLM_")}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    env.update({f"KVCOMPILE_VLLM_{k.upper()}": str(v) for k, v in plugin.items()})
    return env


def run(args: list[str], env: dict, timeout: int) -> dict:
    """The vLLM environment's Python on `args` (in the checkout); it prints one JSON line after RESULT."""
    return result(subprocess.run([str(PYTHON), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=timeout))


def result(proc: subprocess.CompletedProcess) -> dict:
    """The JSON line a successful run printed after RESULT."""
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1].splitlines()[0])


def in_vllm_env(code: str, timeout: int = 240, **plugin) -> dict:
    """`code` run by the vLLM environment's Python (`plugin`: its KVCOMPILE_VLLM_* settings, as vllm_env's)."""
    return run(["-c", code], vllm_env(**plugin), timeout)


def in_vllm_env_job(code: str, timeout: int = 240, **plugin):
    """in_vllm_env's run as a job of the suite's background lane (tests/lane.py); `result` reads what it printed."""
    from lane import Job

    return Job([str(PYTHON), "-c", code], vllm_env(**plugin), str(ROOT), timeout)
