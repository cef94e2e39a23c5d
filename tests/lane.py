"""The suite's background lane: long subprocess runs that a test module asks for when the suite is collected
(its `queue_runs(lane, selected)`, called by tests/conftest.py), run one after another in one thread of the
test process, behind the lowest transformers' run (tests/test_transformers_range.py). On a 2-core machine the
test process mostly keeps one core busy (tiny models: one thread's worth of small ops), so a run of one
thread done beside it costs the suite little, where done when its test comes it costs its whole time.

A test asks for a run's result with `lane.result(key, job)`: done, it is returned; running, the test waits for
it; queued and not started (or never queued: the test selected alone, say), the test runs it at once itself,
so a test never waits for another test's run. Each run is bounded by its own timeout; runs still going when
the session ends (-x, ^C) are killed. Every run writes only under its own folder (`lane.folder(key)`), removed
at the end of the session.
"""
from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    """A command: argv, its environment and working folder, and how long it may run."""

    argv: list[str]
    env: dict
    cwd: str
    timeout: float

    def same(self, other: Job) -> bool:
        """The same command with the same settings (the environment's KVCOMPILE_*, VLLM_*, OMP_* and PYTHONPATH:
        the rest is the test process's own, which its tests change as they run, PYTEST_CURRENT_TEST say)."""
        def settings(job):
            return {k: v for k, v in job.env.items() if k.startswith(("KVCOMPILE_", "VLLM_", "OMP_")) or k == "PYTHONPATH"}
        return ((self.argv, settings(self), self.cwd, self.timeout)
                == (other.argv, settings(other), other.cwd, other.timeout))


@dataclass
class Run:
    job: Job
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: subprocess.CompletedProcess | None = None
    error: BaseException | None = None


class Lane:
    def __init__(self, after: list[subprocess.Popen] = ()):
        self.after = list(after)  # processes the lane waits for before its first run (the lowest transformers')
        self.runs: dict[str, Run] = {}
        self.order: list[str] = []
        self.lock = threading.Lock()
        self.processes: list[subprocess.Popen] = []
        self.stopped = False
        self.thread: threading.Thread | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix="kvcompile_lane_")

    def folder(self, key: str) -> Path:
        """The folder a run (and the test that reads it) writes in."""
        path = Path(self.tmp.name) / key.replace("/", "_").replace(":", "_")
        path.mkdir(exist_ok=True)
        return path

    def queue(self, key: str, job: Job) -> None:
        with self.lock:
            if key not in self.runs:
                self.runs[key] = Run(job)
                self.order.append(key)

    def start(self) -> None:
        if self.order and self.thread is None:
            self.thread = threading.Thread(target=self._work, name="test-lane", daemon=True)
            self.thread.start()

    def result(self, key: str, job: Job) -> subprocess.CompletedProcess:
        """The completed run of `job` (queued under `key` or not): returncode, stdout, stderr."""
        with self.lock:
            run = self.runs.get(key)
            assert run is None or run.job.same(job), f"the run queued as {key!r} is not the one the test asks for"
            mine = run is None or not run.started
            if mine:
                run = self.runs[key] = Run(job, started=True)
        if mine:
            self._execute(run)
        run.done.wait()
        if run.error is not None:
            raise run.error
        return run.result

    def stop(self) -> None:
        with self.lock:  # no run starts after this
            self.stopped = True
        for process in list(self.processes):
            if process.poll() is None:
                process.kill()
                process.wait()
        if self.thread is not None:
            self.thread.join(timeout=60)
        self.tmp.cleanup()

    def _work(self) -> None:
        while any(p.poll() is None for p in self.after):
            if self.stopped:
                return
            time.sleep(1)
        for key in self.order:
            with self.lock:
                run = self.runs[key]
                if run.started:
                    continue
                run.started = True
            self._execute(run)  # (raises nothing: a run after stop() records why it did not run)

    def _execute(self, run: Run) -> None:
        job = run.job
        try:
            with self.lock:
                if self.stopped:
                    raise RuntimeError("the session ended before this run")
                process = subprocess.Popen(job.argv, cwd=job.cwd, env=job.env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
                self.processes.append(process)
            try:
                stdout, stderr = process.communicate(timeout=job.timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise
            run.result = subprocess.CompletedProcess(job.argv, process.returncode, stdout, stderr)
        except BaseException as exc:  # the test that reads the run raises it
            run.error = exc
        finally:
            run.done.set()
