"""The planner: predict memory, step time and MFU of any layout on any cluster, pick the best.

- :mod:`.workload` -- the question: model, batch, precision, and a layout
  (:class:`meshlm.layout.Layout`, parsed from text by :func:`parse_layout`);
- :mod:`.hardware` -- accelerators and clusters (and this machine's calibrated ``cpu``);
- :mod:`.memory` -- per-GPU memory (ZeRO states, Korthikanti activations, buffers);
- :mod:`.timing` -- step time (compute, exposed communication, bubble), tokens/s, MFU;
- :mod:`.search` -- enumerate valid layouts, drop those that do not fit, rank them;
- :mod:`.calibrate` -- measure this machine; :mod:`.cli` -- ``meshlm plan``.
"""

from ..layout import Layout
from .hardware import CATALOGUE, Accelerator, get_accelerator
from .memory import MemoryBreakdown, memory
from .search import Plan, evaluate, search
from .timing import TimeBreakdown, comm_volumes, step_time
from .workload import ModelSpec, Workload, parse_layout

__all__ = [
    "CATALOGUE", "Accelerator", "Layout", "MemoryBreakdown", "ModelSpec", "Plan",
    "TimeBreakdown", "Workload", "comm_volumes", "evaluate", "get_accelerator",
    "memory", "parse_layout", "search", "step_time",
]
