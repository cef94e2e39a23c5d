"""The suite's background lane (tests/lane.py): queued runs run one after another once the processes it waits
for have ended; a test gets a run's result, running it itself when the lane has not started it; the session's
end kills what still runs."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lane import Job, Lane


def job(code: str, timeout: float = 60) -> Job:
    return Job([sys.executable, "-c", code], dict(os.environ), os.getcwd(), timeout)


def test_queued_runs_run_in_order_after_the_awaited_process():
    begun = time.time()
    blocker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    lane = Lane(after=[blocker])
    try:
        stamp = "import time; print(time.time())"
        lane.queue("a", job(stamp))
        lane.queue("b", job(stamp))
        lane.start()
        while not all(run.done.is_set() for run in lane.runs.values()):
            time.sleep(0.1)
        a, b = (float(lane.result(key, job(stamp)).stdout) for key in "ab")
        assert blocker.poll() == 0 and begun + 1.5 <= a < b  # after the blocker's sleep, a before b
        assert lane.result("a", job(stamp)).stdout == lane.runs["a"].result.stdout  # kept, not run again
    finally:
        lane.stop()


def test_a_run_not_started_is_run_by_the_test_that_asks():
    blocker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    lane = Lane(after=[blocker])
    try:
        lane.queue("a", job("print('done')"))
        lane.start()
        got = lane.result("a", job("print('done')"))  # the lane still waits for the blocker
        assert got.returncode == 0 and got.stdout == "done\n" and blocker.poll() is None
        assert lane.result("never queued", job("print(2)")).stdout == "2\n"
    finally:
        blocker.kill()
        blocker.wait()
        lane.stop()


def test_a_test_asking_for_another_command_under_a_queued_key_fails():
    lane = Lane(after=[])
    try:
        lane.queue("a", job("print(1)"))
        with pytest.raises(AssertionError, match="the run queued as 'a' is not the one the test asks for"):
            lane.result("a", job("print(2)"))
    finally:
        lane.stop()


def test_a_run_past_its_timeout_raises_and_stop_kills_what_runs():
    lane = Lane(after=[])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            lane.result("slow", job("import time; time.sleep(30)", timeout=0.5))
        lane.queue("long", job("import time; time.sleep(60)"))
        lane.start()
        while len(lane.processes) < 2:  # the timed-out run's, then the long one's
            time.sleep(0.05)
        process = lane.processes[-1]
    finally:
        lane.stop()
    assert process.poll() is not None


def test_nothing_starts_once_the_lane_is_stopped():
    """The session's end stops the lane before it kills the process the lane waits for (tests/conftest.py): the
    queued runs then never start."""
    blocker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    lane = Lane(after=[blocker])
    lane.queue("a", job("print(1)"))
    lane.start()
    lane.stop()
    blocker.kill()
    blocker.wait()
    lane.thread.join(timeout=10)
    assert lane.processes == [] and not lane.runs["a"].started
    with pytest.raises(RuntimeError, match="the session ended before this run"):
        lane.result("a", job("print(1)"))
