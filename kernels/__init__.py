"""Kernels (packaged as kvcompile.kernels): each a Triton version beside a torch lowering."""
