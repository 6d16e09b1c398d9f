"""How expert parallelism's tokens cross nodes: the share of a dispatch that the network carries.

An expert-parallel group of ``n`` ranks spanning several nodes (``local`` of them per node)
exchanges each routed token's hidden vector twice per layer and pass (dispatch, combine).
What crosses the network depends on the dispatcher:

- ``all-to-all``: one copy per selected expert, sent straight to the expert's rank (NCCL's
  all-to-all: meshlm, Megatron-Core's ``alltoall`` dispatcher). Balanced routing spreads the
  copies evenly over the ranks, so ``(n - local) / n`` of the buffer crosses the network and
  ``(local - 1) / n`` stays on the node's NVLink.
- ``node-dedup``: each token crosses the network once per destination node, then is forwarded
  over NVLink to that node's selected experts (DeepEP's internode kernels; DeepSeek-V3
  sec. 3.2.2). The network carries the remote nodes a token touches out of its ``k`` copies:
  ``k`` experts drawn evenly over ``N = n / local`` nodes touch ``N (1 - (1 - 1/N)^k)`` of
  them, at most the ``topk_group`` groups a group-limited router allows where its groups
  are the nodes (DeepSeek-V3: 4 of 8), and the remote ones are ``(N - 1) / N`` of those.
  NVLink then carries every copy but the rank's own.

Both return (network share, NVLink share) of the buffer of ``k`` copies per token; the
collective takes the longer of the two transfers, which run at once
(``timing.collective_time``). Communication only; no memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..named import Registry


@dataclass(frozen=True)
class Dispatch:
    """One dispatcher: its name, what it is, and its (network, NVLink) shares."""

    name: str
    doc: str
    shares: Callable[[int, int, int, int, int], tuple[float, float]]


def _all_to_all(n: int, local: int, k: int, n_group: int, topk_group: int
                ) -> tuple[float, float]:
    return (n - local) / n, (local - 1) / n


def nodes_touched(nodes: int, k: int, n_group: int = 1, topk_group: int = 1) -> float:
    """Expected distinct nodes ``k`` evenly routed copies land on, over ``nodes`` nodes; a
    group-limited router whose groups are the nodes caps it at ``topk_group``."""
    touched = nodes * (1 - (1 - 1 / nodes) ** k)
    if n_group > 1 and n_group == nodes:
        touched = min(touched, topk_group)
    return touched


def _node_dedup(n: int, local: int, k: int, n_group: int, topk_group: int
                ) -> tuple[float, float]:
    nodes = max(1, n // local)
    remote = nodes_touched(nodes, k, n_group, topk_group) * (nodes - 1) / nodes
    return remote / k, (n - 1) / n


EP_DISPATCHES: Registry[Dispatch] = Registry("ep dispatch")
for _d in (Dispatch("all-to-all", "one copy per selected expert (NCCL all-to-all)", _all_to_all),
           Dispatch("node-dedup", "once per destination node, forwarded over NVLink (DeepEP)",
                    _node_dedup)):
    EP_DISPATCHES.register(_d)


def shares(name: str, cfg: Any, n: int, local: int) -> tuple[float, float]:
    """(network, NVLink) shares of an expert-parallel dispatch of ``cfg``'s routing over ``n``
    ranks, ``local`` per node."""
    return EP_DISPATCHES[name].shares(n, local, cfg.moe_topk, cfg.moe_n_group,
                                      cfg.moe_topk_group)


__all__ = ["EP_DISPATCHES", "Dispatch", "nodes_touched", "shares"]
