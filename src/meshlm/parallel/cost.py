"""What the cost descriptions of the techniques share: a collective and a registry.

Each technique describes its cost in a torch-free module beside its implementation
(``zero_cost.py`` beside ``zero.py``, ``schedule_cost.py`` beside ``schedules.py``, ...),
registered under the name the config uses for it (:mod:`meshlm.layout`: ``ZERO_STAGES``,
``SCHEDULES``, ``RECOMPUTE``, ``OFFLOADS``, ``CP_MODES``). The planner reads the descriptions
and assembles them: it places each :class:`Collective` on the mesh (which axis, how many ranks,
how far apart), times it over the link that axis crosses and applies its overlap.

Communication: none. Memory: none.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..named import Registry


@dataclass(frozen=True)
class Collective:
    """One kind of message of a step: ``calls`` calls of ``nbytes`` bytes (comm-log bytes).

    ``overlap`` names what hides it (the planner's timing applies it): ``exposed``;
    ``last_backward`` (bucketed beside the last micro-batch's backward); ``each_backward``;
    ``zero3`` (prefetched gathers and in-flight reduce-scatters); ``attention`` (beside the
    attention compute); ``gemm`` (beside the GEMMs); ``free`` (the other side of a timed send).
    ``over`` names which of the technique's groups it runs over ("" its only one).
    """

    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send, recv
    nbytes: float
    calls: float
    overlap: str
    over: str = ""


__all__ = ["Collective", "Registry"]
