"""Optimizer-state offload as the planner sees it (torch-free): device bytes, traffic, host step.

The modes themselves are :mod:`.offload` (torch); ``parallel.offload`` accepts exactly the
names here. Per rank, of Ψ_o parameters its optimizer owns:

- ``none``: the AdamW moments live on the device beside the weights;
- ``cpu`` (ZeRO-Offload, Ren et al. 2021): the moments leave the device (0 device bytes,
  reported as host memory); on a GPU each step copies weights and gradients to the host and
  the weights back, 12 Ψ_o bytes over the host link, and AdamW runs on the host, in series
  (meshlm's chunks wait for their copies). On a CPU run ``cpu`` is ``none``: the moments are
  already in host memory, and nothing is copied;
- ``disk`` (ZeRO-Infinity's NVMe tier, Rajbhandari et al. 2021): the moments leave the device;
  both (8 Ψ_o bytes) are paged in and written back each step, 16 Ψ_o bytes through the page
  cache at the rate of fresh (page-faulting) buffers; AdamW runs where it did.

The planner times the traffic at the machine's rates (host link, memory bandwidth, host AdamW
per parameter) and reports it exposed. Communication: none (the step stays local).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Registry


@dataclass(frozen=True)
class OffloadCost:
    """One offload mode's cost, as the planner reads it (see the module docstring)."""

    name: str
    doc: str
    off_device: bool = False  # the moments leave the device
    page_bytes: int = 0  # per owned parameter and step, through the page cache
    link_bytes: int = 0  # per owned parameter and step, over the host link (GPU runs only)
    host_step: bool = False  # AdamW runs on the host (GPU runs only)


OFFLOAD: Registry[OffloadCost] = Registry("offload mode")
OFFLOAD.register(OffloadCost("none", "the moments on the device"))
OFFLOAD.register(OffloadCost("cpu", "the moments in host memory; AdamW on the host",
                             off_device=True, link_bytes=12, host_step=True))
OFFLOAD.register(OffloadCost("disk", "the moments in a file per rank, paged in each step",
                             off_device=True, page_bytes=16))

__all__ = ["OFFLOAD", "OffloadCost"]
