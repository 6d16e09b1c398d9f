"""The build tools ``train.compile`` needs: inductor's C++ compiler on CPU, Triton on CUDA.

Checked when a config with ``train.compile = true`` is validated, so a missing compiler is one
clear error before any worker starts.
"""

from __future__ import annotations

import os
import shutil


class CompileError(RuntimeError):
    """``train.compile = true`` cannot work on this machine (no C++ compiler, no Triton)."""


def check_compiler(device_type: str) -> None:
    """Raise :class:`CompileError` when inductor cannot build kernels for ``device_type``:
    CPU kernels need a C++ compiler (``$CXX``, g++ or clang++), CUDA kernels Triton."""
    if device_type == "cuda":  # GPU-only path, untested on the CPU machines meshlm's tests run on
        from torch.utils._triton import has_triton

        if not has_triton():
            raise CompileError("train.compile=true on CUDA needs Triton (pip install triton), "
                               "which this environment lacks; set train.compile=false")
        return
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if not any(shutil.which(n) for n in names):
        raise CompileError(
            f"train.compile=true needs a C++ compiler for inductor's CPU kernels; none of "
            f"{', '.join(names)} is on PATH (install g++, or set CXX; or train.compile=false)")
