"""Shared test setup.

Without a CUDA GPU, Triton kernels run in its interpreter, which must be switched on
before triton is first imported (docs/INTERNALS.md "Kernels": Triton without a GPU). torch does not
import triton, so asking torch about CUDA here is safe.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


LOWEST = "test_transformers_range.py::test_the_tests_of_the_internals_pass_on_the_lowest_transformers"
STARTED = []  # the lowest transformers' run, where this session started it


def pytest_collection_finish(session):
    """Where the lowest transformers' run is selected (after -k and --deselect), start it as soon as the suite is
    collected, beside the other tests (tests/test_transformers_range.py, LowestRun): one process of one torch
    thread."""
    for item in session.items:
        if item.nodeid.endswith(LOWEST):
            run = item.module.start_lowest_run()
            if run is not None:
                STARTED.append(run)


def pytest_sessionfinish(session, exitstatus):
    """The run ends with the session (killed if the session stopped before waiting for it: -x, ^C)."""
    for run in STARTED:
        run.stop()
