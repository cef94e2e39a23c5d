"""kvcompile: compile declarative KV-cache compression policies into a running model."""
from kvcompile.policy import Policy

__all__ = ["Policy"]
