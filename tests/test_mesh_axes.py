"""The mesh's axes are one table: every size, rank and group follows from ``AXIS_DEFS``.

In one process (no torch.distributed), for many layouts -- hybrid sharding, experts, islands
included -- each axis's rank sets partition the world, this rank's set has ``size(axis)`` ranks
and this rank sits at ``local_rank(axis)`` in it. The hybrid axes split dp as
``dp_rep x dp_shard`` (shard groups of consecutive dp ranks), and without hybrid sharding they
are the whole axes. A spawned world of four with dp 4, dp_shard 2 checks that a collective over
each hybrid group sums exactly its ranks, and that the spec bookkeeping of a sharded tensor
keeps the replica axis (what checkpoints and norms read).
"""

from __future__ import annotations

import itertools

import pytest

from meshlm.distributed.mesh import (
    AXIS_DEFS,
    HYBRID_AXES,
    Mesh,
    without_sharded,
)
from meshlm.layout import Layout
from meshlm.testing import run_world


def _mesh_at(layout: Layout, rank: int) -> Mesh:
    """A Mesh of ``layout`` as rank ``rank`` sees it, without process groups."""
    m = Mesh.__new__(Mesh)
    m.layout, m.world_size, m.islands = layout, layout.world_size, layout.islands
    m.rank, m.island, m._groups = rank, rank // layout.inner_size, {}
    m.coords = layout.coords(rank % layout.inner_size)
    return m


LAYOUTS = [
    Layout(dp=4, zero=3, dp_shard=2),
    Layout(dp=4, cp=2, zero=1, dp_shard=2, ep=2),
    Layout(pp=2, dp=4, tp=2, zero=3, dp_shard=2),
    Layout(dp=8, zero=2, dp_shard=4, ep=4),
    Layout(dp=2, cp=2, tp=2, ep=4, zero=1),
    Layout(islands=2, dp=4, zero=3, dp_shard=2),
    Layout(pp=2, dp=2, cp=2, tp=2),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.describe() for lay in LAYOUTS])
def test_every_axis_partitions_the_world_and_agrees_with_size_and_rank(layout: Layout) -> None:
    world = layout.world_size
    for axis in AXIS_DEFS:
        sets = _mesh_at(layout, 0).rank_sets(axis)
        assert sorted(itertools.chain(*sets)) == list(range(world)), axis
        for rank in range(world):
            m = _mesh_at(layout, rank)
            mine = next(s for s in sets if rank in s)
            assert len(mine) == m.size(axis), (axis, rank)
            assert mine.index(rank) == m.local_rank(axis), (axis, rank)


def test_hybrid_axes_split_dp_into_replicas_of_consecutive_shard_groups() -> None:
    m = _mesh_at(Layout(dp=4, cp=2, ep=2, zero=3, dp_shard=2), 5)  # rank 5: dp 2, cp 1
    assert m.rank_sets("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.rank_sets("dp_rep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.rank_sets("dp_shard_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.rank_sets("edp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.shard_axis("dp_cp") == "dp_shard_cp" and m.shard_axis("edp") == "edp_shard"
    assert m.replica_axis("dp_cp") == "dp_rep" and m.replica_axis("tp") is None
    # the expert copies: dp_rep outer, edp_shard inner
    assert m.local_rank("edp") == m.local_rank("dp_rep") * m.size("edp_shard") + m.local_rank(
        "edp_shard")
    assert m.grad_divisor("edp_shard") == m.grad_divisor("edp") == 8


def test_without_hybrid_sharding_the_hybrid_axes_are_the_whole_axes() -> None:
    layout = Layout(dp=4, cp=2, zero=3)
    m = _mesh_at(layout, 3)
    for hybrid, whole in (("dp_shard", "dp"), ("dp_shard_cp", "dp_cp")):
        assert m.rank_sets(hybrid) == m.rank_sets(whole)
        assert m.shard_axis(whole) == whole
    assert m.size("dp_rep") == 1 and m.replica_axis("dp") is None
    assert set(HYBRID_AXES) <= set(AXIS_DEFS)


def test_sharding_keeps_the_replica_axis_of_a_hybrid_copy() -> None:
    assert without_sharded(("dp", "cp", "tp"), "dp_cp") == ("tp",)
    assert without_sharded(("dp", "cp", "tp"), "dp_shard_cp") == ("dp_rep", "tp")
    assert without_sharded(("dp",), "dp_shard") == ("dp_rep",)
    assert without_sharded(("tp", "edp"), "edp_shard") == ("tp", "dp_rep")
    assert without_sharded(("tp", "edp"), "edp") == ("tp",)


def hybrid_body(_: object) -> dict:
    """World body: sums over every group of dp 4, dp_shard 2, and a ZeRO shard's spec."""
    import torch
    import torch.distributed as dist

    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.distributed.spec import ShardSpec, first_copy

    mesh = Mesh(Layout(dp=4, zero=3, dp_shard=2))
    comm = Comm(mesh)
    sums = {}
    for axis in ("dp", "dp_rep", "dp_shard", "dp_cp", "dp_shard_cp"):
        t = torch.tensor([float(dist.get_rank() + 1)])
        comm.all_reduce(t, axis)
        sums[axis] = t.item()
    spec = ShardSpec("w", (8,), (8,), (0,), replicated=without_sharded(("dp",), "dp_shard"))
    return {"sums": sums, "groups": mesh.group_ranks(), "first_copy": first_copy(spec, mesh),
            "weight": spec.norm_weight(mesh, ("dp",))}


def test_hybrid_groups_sum_exactly_their_ranks() -> None:
    results = run_world(4, hybrid_body, None)
    for rank, res in enumerate(results):
        shard = [r for r in range(4) if r // 2 == rank // 2]
        rep = [r for r in range(4) if r % 2 == rank % 2]
        assert res["sums"]["dp_shard"] == sum(r + 1 for r in shard)
        assert res["sums"]["dp_shard_cp"] == sum(r + 1 for r in shard)
        assert res["sums"]["dp_rep"] == sum(r + 1 for r in rep)
        assert res["sums"]["dp"] == res["sums"]["dp_cp"] == 10
        assert res["groups"]["dp_shard"] == shard and res["groups"]["dp_rep"] == rep
        # a shard is written by the first replica only; a norm over dp counts each copy half
        assert res["first_copy"] == (rank < 2)
        assert res["weight"] == 0.5
