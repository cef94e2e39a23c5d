"""Shared test setup.

Without a CUDA GPU, Triton kernels run in its interpreter, which must be switched on
before triton is first imported (docs/INTERNALS.md "Kernels": Triton without a GPU). torch does not
import triton, so asking torch about CUDA here is safe.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
