"""The value-source protocol (defined with the shard specs, below the parallel layer)."""

from ..distributed.source import InitSource, TensorSource

__all__ = ["InitSource", "TensorSource"]
