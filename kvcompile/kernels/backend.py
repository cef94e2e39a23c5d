"""What every kernel backend has (one class per implementation of a kernel family, chosen once by
`kvcompile.plan.build_plan` and held by the Plan: docs/INTERNALS.md "Kernel backends")."""
from __future__ import annotations

from typing import ClassVar


class KernelBackend:
    """A kernel family's base class derives from this: `name` is the implementation (`choice.resolve`'s
    name, what `plan.describe()` shows), `build` compiles ahead of time what the implementation needs
    (the C++ kernels; nothing for the others), `describe` is the plan's line for it (a backend with
    thresholds adds them)."""

    name: ClassVar[str | None]

    def build(self, group: int, head_dim: int) -> None:
        """Build (or load) what the backend compiles ahead of time (a C++ kernel); else nothing."""

    def describe(self) -> str:
        return self.name
