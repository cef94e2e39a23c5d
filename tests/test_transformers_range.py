"""The lowest transformers that pyproject allows runs the tests of the transformers internals kvcompile relies
on (docs/INTERNALS.md "Supported transformers versions"). CI's `pip install` brings the newest allowed
version, which the rest of the suite runs on; this file runs the tests below again in a subprocess whose
Python imports pyproject's lowest (`.transformers-lowest/`, made by `bash scripts/setup.sh test` or `all`:
scripts/transformers_lowest.py), and checks there that it really is that version.

Chosen by what they exercise of transformers (TESTS), file by file:
- test_transformers_patches: the table of every internal kvcompile overrides, swaps, registers or reads, each row
  against the lowest release's source.
- test_serving, test_reuse_engine, test_scheduler_stall: the continuous batching engine kvcompile subclasses and
  swaps (PagedAttentionCache, the manager and batch processor, the model runner, the scheduler: the table's
  "batching" rows).
- test_serve_http: `kvcompile serve` over that engine, and the per-request sampling through generate()'s logits
  processors and generation config (`_get_logits_processor`, `_prepare_generation_config`).
- test_generate_compat: every generate() path over kvcompile's Cache (crop, beam reordering, assisted decoding,
  prefix deepcopy, cache_implementation, pipelines, accelerate's hooks), eager and compiled.
- test_runtime: the attention and mask registrations and the attention kwargs of Llama, Mistral and Qwen2.
- test_compiled: the compiled entry's capture of the models' forward (not its Inductor cache across processes:
  torch's, DESELECT).
- test_tensor_parallel, test_distributed_doc: `tp_plan="auto"` sharding and the model's tp_plan (5.20 did not shard
  the embedding over the vocabulary). Every config (Llama and Qwen2, 2 and 4 KV heads), the compiled and refused jobs and the
  collectives test run; of the every-spec test, one spec per kind of collective and state (TP_SPECS): which
  heads a rank holds and what transformers sums over ranks do not depend on the policy, whose collectives are
  kvcompile's own.
- test_devices: accelerate's hooks on a model loaded with a device_map or offloaded. Not its simulations
  (DESELECT): the pipeline over simulated devices and the decode steps' host reads check kvcompile's placement of
  pages per layer and its decode step, on the same device_map loading the offload tests run here.
Not here: test_models (the embedded model's GGUF, read by transformers' public from_pretrained(gguf_file=...)
and compared with the folder the newest transformers converted at set-up; the needle prompts and haystack use
no transformers internal).
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("transformers_lowest", ROOT / "scripts" / "transformers_lowest.py")
lowest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lowest)

TESTS = ["tests/test_transformers_patches.py", "tests/test_serving.py", "tests/test_serve_http.py", "tests/test_reuse_engine.py",
         "tests/test_scheduler_stall.py", "tests/test_generate_compat.py", "tests/test_runtime.py",
         "tests/test_compiled.py", "tests/test_devices.py", "tests/test_tensor_parallel.py",
         "tests/test_distributed_doc.py"]
# Not transformers: torch's Inductor cache across processes; the simulated devices (see the docstring).
DESELECT = ["tests/test_compiled.py::test_a_second_process_reuses_the_inductor_cache",
            "tests/test_devices.py::test_pipelines_on_simulated_devices",
            "tests/test_devices.py::test_decode_steps_on_a_simulated_device_read_nothing_back"]
# test_tensor_parallel's every-spec test, on the lowest: a selection gathering counts, one gathering scores, the
# per-head threshold (no exchange), a merge (residual slots) and decode-time pruning with a cascade
TP_SPECS = ("snapkv", "adakv", "dbudgetkv", "zsmerge", "lava_every")


def deselected() -> list[str]:
    """DESELECT, and test_tensor_parallel's every-spec test for the specs not in TP_SPECS (its fixture runs only
    what the selected tests need)."""
    from test_tensor_parallel import CONFIGS, NAMES

    assert set(TP_SPECS) <= set(NAMES), set(TP_SPECS) - set(NAMES)
    return DESELECT + [f"tests/test_tensor_parallel.py::test_ranks_keep_what_one_process_keeps[{config}-{name}]"
                       for config in CONFIGS for name in NAMES if name not in TP_SPECS]


# Skips that do not depend on the transformers version (the same tests skip in this run).
ALLOWED_SKIPS = re.compile(r"CUDA|GPU|setup\.sh|C\+\+ toolchain")
TIMEOUT = 3600  # seconds for the whole subprocess: only stops a run that hangs (about 4 minutes on a loaded one)

# Runs in the subprocess, before pytest: the tests must import the lowest transformers from the environment.
CHECK = """
import os, sys, transformers
from packaging.version import Version
want, folder = sys.argv[1], os.path.realpath(sys.argv[2])
have, where = transformers.__version__, os.path.realpath(transformers.__file__)
print(f"transformers {have} from {where}", flush=True)
if Version(have) != Version(want) or not where.startswith(folder + os.sep):
    sys.exit(f"expected transformers {want} from {folder}")
import pytest
sys.exit(pytest.main(sys.argv[3:]))
"""


def test_pyproject_names_one_lower_bound():
    version = lowest.lowest_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version


def test_setup_installs_the_top_of_the_range():
    """setup.sh upgrades transformers to the newest release pyproject's requirement allows (the suite runs
    on the top of the range) from the requirement transformers_lowest.py prints."""
    req = lowest.requirement()
    assert req.name == "transformers" and lowest.lowest_version() in str(req)
    assert any(s.operator == "<" for s in req.specifier), "an upper bound: the newest release the suite ran on"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'pip install -q --upgrade "$("$py" scripts/transformers_lowest.py requirement)"' in setup


def test_the_check_refuses_a_run_on_another_transformers():
    """This Python (the newest transformers, from its own site-packages) does not pass for the lowest."""
    done = subprocess.run([sys.executable, "-c", CHECK, lowest.lowest_version(), str(lowest.FOLDER), "--co", "-q",
                           "tests/test_spec.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"expected transformers {lowest.lowest_version()} from" in done.stderr, done.stderr


class LowestRun:
    """The lowest transformers' run of TESTS, a subprocess of one torch thread started when the suite's collection
    selects the test below (tests/conftest.py), so that it runs beside the rest of the suite instead of after it
    (about 6 minutes of a quiet machine's suite); its output goes to files, read when the test asks for it."""

    def __init__(self):
        self.folder = tempfile.TemporaryDirectory(prefix="transformers_lowest_")
        folder = Path(self.folder.name)
        self.want = lowest.lowest_version()
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        args = ["-q", "-p", "no:cacheprovider", "-rs", *TESTS, *[f"--deselect={d}" for d in deselected()]]
        self.out, self.err = open(folder / "stdout", "w+"), open(folder / "stderr", "w+")
        self.process = subprocess.Popen([str(lowest.python()), "-c", CHECK, self.want, str(lowest.FOLDER), *args],
                                        cwd=ROOT, env=env, stdout=self.out, stderr=self.err, text=True)

    def result(self) -> tuple[int, str, str]:
        """(return code, stdout, stderr), once the run has ended (TIMEOUT after it began at the latest)."""
        self.process.wait(timeout=TIMEOUT)
        self.out.seek(0)
        self.err.seek(0)
        return self.process.returncode, self.out.read(), self.err.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.out.close()
        self.err.close()
        self.folder.cleanup()


RUNS: list[LowestRun] = []  # the run this session started (tests/conftest.py), at most one


def start_lowest_run() -> LowestRun | None:
    """Start the run now if the lowest transformers is prepared (else the test skips, saying why)."""
    got = lowest.installed()
    if got is not None and got[0] == lowest.lowest_version() and not RUNS:
        RUNS.append(LowestRun())
        return RUNS[0]
    return None


def test_the_tests_of_the_internals_pass_on_the_lowest_transformers():
    want = lowest.lowest_version()
    got = lowest.installed()
    if got is None:
        pytest.skip(f"{lowest.FOLDER.name}/ not prepared: run `bash scripts/setup.sh test` (or `all`), which installs "
                    f"pyproject's lowest transformers ({want}) there")
    from packaging.version import Version

    assert Version(got[0]) == Version(want), (f"{lowest.FOLDER.name}/ holds transformers {got[0]}, pyproject's "
                                              f"lowest is {want}: run `bash scripts/setup.sh test`")
    started_here = not RUNS  # not started at collection (tests/conftest.py): start it now
    run = RUNS[0] if RUNS else start_lowest_run()
    try:
        returncode, stdout, stderr = run.result()
    finally:
        if started_here:
            run.stop()
    out = stdout + stderr
    tail = out[-6000:]
    assert re.search(rf"^transformers {re.escape(want)} from ", stdout, re.M), tail  # not some other version
    assert returncode == 0, tail
    summary = re.search(r"^(\d+) passed(.*)$", stdout, re.M)  # "N passed, M skipped, ... in T s"
    assert summary and int(summary.group(1)) > 0 and not re.search(r"failed|error", summary.group(2)), tail
    skips = [line for line in stdout.splitlines() if line.startswith("SKIPPED")]
    assert all(ALLOWED_SKIPS.search(line) for line in skips), "\n".join(skips)
