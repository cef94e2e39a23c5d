"""Shared test setup.

Without a CUDA GPU, Triton kernels run in its interpreter, which must be switched on
before triton is first imported (docs/INTERNALS.md "Kernels": Triton without a GPU). torch does not
import triton, so asking torch about CUDA here is safe.
"""
import os

import pytest
import torch

from lane import Lane

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


LOWEST = "test_transformers_range.py::test_the_tests_of_the_internals_pass_on_the_lowest_transformers"
STARTED = []  # the lowest transformers' run, where this session started it
LANE = pytest.StashKey[Lane]()


def pytest_collection_finish(session):
    """Where the lowest transformers' run is selected (after -k and --deselect), start it as soon as the suite is
    collected, beside the other tests (tests/test_transformers_range.py, LowestRun): one process of one torch
    thread. Then the background lane (tests/lane.py): the long runs the selected tests' modules queue, one after
    another once that run has ended."""
    for item in session.items:
        if item.nodeid.endswith(LOWEST):
            run = item.module.start_lowest_run()
            if run is not None:
                STARTED.append(run)
    lane = session.config.stash[LANE] = Lane(after=[run.process for run in STARTED])
    if session.config.option.collectonly:
        return
    selected = {getattr(item, "originalname", item.name) for item in session.items}
    modules = {id(m): m for m in (getattr(item, "module", None) for item in session.items) if m is not None}
    for module in modules.values():
        if hasattr(module, "queue_runs"):  # its long subprocess runs, into the background lane (tests/lane.py)
            module.queue_runs(lane, selected)
    lane.start()


@pytest.fixture(scope="session")
def lane(request) -> Lane:
    """The background lane (tests/lane.py) this session's collection filled."""
    return request.config.stash[LANE]


def pytest_sessionfinish(session, exitstatus):
    """The runs end with the session (killed if the session stopped before waiting for them: -x, ^C); the lane
first, so that it starts nothing once the lowest transformers' run it waits for is killed."""
    if LANE in session.config.stash:
        session.config.stash[LANE].stop()
    for run in STARTED:
        run.stop()
