"""Mixed precision: autocast compute dtype over fp32 master weights, loss scaling for fp16.

``fp32``: everything in fp32. ``bf16``: matmuls in bf16 under autocast, weights, gradients and
optimizer states in fp32 (bf16 has fp32's exponent range, so no loss scaling). ``fp16``: as bf16
plus a dynamic loss scaler (``torch.amp.GradScaler``) because fp16 gradients underflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast context and optional grad scaler for one device type."""

    def __init__(self, dtype: str, device_type: str = "cpu") -> None:
        self.name = dtype
        self.dtype = DTYPES[dtype]
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type) if dtype == "fp16" else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.dtype == torch.float32:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
