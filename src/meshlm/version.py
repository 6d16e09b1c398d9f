"""The package's version (one place; ``meshlm.__version__`` reads it)."""

__version__ = "0.1.0"
