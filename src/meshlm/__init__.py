"""meshlm: readable 5D-parallel LLM training on PyTorch."""

from .version import __version__


def load_model(path: str, device: str = "cpu"):  # noqa: ANN201 - lazy import keeps CLI start fast
    """The plain model from a meshlm run directory or checkpoint directory."""
    from .checkpoint.loading import load_model as _load

    return _load(path, device=device)


__all__ = ["__version__", "load_model"]
