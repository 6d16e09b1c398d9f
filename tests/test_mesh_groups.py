"""Process groups of the mesh: one group object (one communicator) per distinct set of ranks.

On a spawned gloo world of four, for sample layouts: axes whose rank sets are equal share one
group object (``dp_cp`` is the world when pp = tp = 1, ``ep``/``edp`` are the cp/dp groups when
ep = cp, ``inner`` the dp group of two islands of two), except the pipeline's: the pp group and
the embedding group are shared with nothing, even where their ranks are the same (pp = 2); an
axis of size 1 has no group, the number of groups torch creates is the number of distinct
rank sets (plus those two), and a collective over every group sums over exactly its ranks.
The embedding group is made only when asked for (``Mesh.build_embed_group``, which the pipeline
model calls when it keeps an embedding table on both ends): a mesh alone makes none.
(Sharing pp with the embedding group deadlocks a pipeline with tied embeddings: the pp = 2
training runs of test_pipeline and test_expert_parallel hang then.) The grouping bookkeeping
is also checked in one process, without torch.distributed.
"""

from __future__ import annotations

import pytest

from meshlm.distributed.mesh import GroupMaker
from meshlm.testing import run_world

# layout -> new_group calls (all ranks alike) = the rank sets of size > 1 that are not the
# world nor any set made before. Each set is one communicator.
LAYOUTS = {
    "dp2-tp2": ({"dp": 2, "tp": 2}, 4),  # dp {0,2} {1,3}, tp {0,1} {2,3}; dp_cp = edp = dp
    "dp2-cp2-ep2": ({"dp": 2, "cp": 2, "ep": 2}, 4),  # dp_cp = world, ep = cp, edp = dp
    "pp2-dp2": ({"pp": 2, "dp": 2}, 6),  # embed {0,2} {1,3} = pp's ranks, its own groups
    "islands2-pp2": ({"islands": 2, "pp": 2}, 8),  # inner = embed = pp ranks: three kinds
    "islands2-dp2": ({"islands": 2, "dp": 2}, 4),  # island {0,2} {1,3}, inner = dp
    "pp4": ({"pp": 4}, 1),  # pp = world; embed {0, 3} is the only new set
}
# the embedding group's new_group calls among them (made by build_embed_group only)
EMBED_SETS = {"pp2-dp2": 2, "islands2-pp2": 2, "pp4": 1}


def groups_body(layouts: dict[str, dict]) -> dict[str, dict]:
    """World body: each layout's groups as this rank sees them."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout

    out = {}
    for name, kw in layouts.items():
        before = distributed_c10d._world.group_count
        mesh = Mesh(Layout(**kw))
        plain = distributed_c10d._world.group_count - before
        plain_embed = mesh.group("embed")
        mesh.set_timeout(1234.0)  # (a group made later gets the timeout the others have)
        mesh.build_embed_group()
        mesh.build_embed_group()  # (again: a no-op)
        embed = mesh.group("embed")
        embed_timeout = (embed._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                         if embed is not None else None)
        made = distributed_c10d._world.group_count - before
        groups = {a: mesh.group(a) for a in mesh._groups}
        ranks = mesh.group_ranks()
        by_set: dict[tuple[int, ...], set[int]] = {}
        for axis, group in groups.items():
            if group is not None and axis not in ("pp", "embed"):  # (shared with nothing)
                by_set.setdefault(tuple(ranks[axis]), set()).add(id(group))
        sums = {}
        comm = Comm(mesh)
        for axis, group in groups.items():
            if group is not None and axis in ("world", "inner", "embed", "pp", "dp", "cp", "tp",
                                              "dp_cp", "ep", "edp", "island"):
                t = torch.tensor([float(dist.get_rank() + 1)])
                comm.all_reduce(t, axis)
                sums[axis] = t.item()
        out[name] = {
            "made": made, "plain": plain, "plain_embed": plain_embed is not None,
            "embed_timeout": embed_timeout,
            "ranks": ranks, "sets": {k: len(v) for k, v in by_set.items()},
            "none": sorted(a for a, g in groups.items() if g is None),
            "same": {a: [b for b in groups if groups[b] is not None and groups[b] is groups[a]]
                     for a in groups if groups[a] is not None},
            "world": groups["world"] is dist.group.WORLD, "sums": sums,
            "sizes": {a: mesh.size(a) for a in groups},
        }
    return out


def test_equal_rank_sets_share_one_group() -> None:
    layouts = {name: kw for name, (kw, _) in LAYOUTS.items()}
    results = run_world(4, groups_body, layouts)
    for rank, res in enumerate(results):
        for name, (_, made) in LAYOUTS.items():
            r = res[name]
            assert r["made"] == made, (name, rank, r["made"])
            assert r["plain"] == made - EMBED_SETS.get(name, 0), (name, rank, r["plain"])
            assert not r["plain_embed"], name
            assert r["embed_timeout"] in (None, 1234.0), (name, r["embed_timeout"])
            assert all(n == 1 for n in r["sets"].values()), (name, rank, r["sets"])
            assert r["world"]
            if "embed" in r["same"]:
                assert r["same"]["embed"] == ["embed"], (name, r["same"])
            for axis, members in r["ranks"].items():  # every collective: exactly its ranks
                assert rank in members and len(members) == r["sizes"][axis] > 1, (name, axis)
                assert r["sums"][axis] == sum(m + 1 for m in members), (name, axis)
        same = {name: res[name]["same"] for name in LAYOUTS}
        assert sorted(same["dp2-tp2"]["dp"]) == ["dp", "dp_cp", "edp"]
        assert "pp" in res["dp2-tp2"]["none"] and "cp" in res["dp2-tp2"]["none"]
        assert sorted(same["dp2-cp2-ep2"]["world"]) == ["dp_cp", "inner", "world"]
        assert sorted(same["dp2-cp2-ep2"]["cp"]) == ["cp", "ep"]
        assert sorted(same["dp2-cp2-ep2"]["dp"]) == ["dp", "edp"]
        assert same["pp2-dp2"]["pp"] == ["pp"] and same["pp2-dp2"]["embed"] == ["embed"]
        assert res["pp2-dp2"]["ranks"]["embed"] == res["pp2-dp2"]["ranks"]["pp"]
        assert same["islands2-pp2"]["inner"] == ["inner"]  # (not pp's, not embed's)
        assert res["islands2-pp2"]["ranks"]["inner"] == res["islands2-pp2"]["ranks"]["pp"]
        assert sorted(same["islands2-dp2"]["dp"]) == ["dp", "dp_cp", "edp", "inner"]
        assert sorted(same["pp4"]["world"]) == ["inner", "pp", "world"]  # (torch's own pp)
        # the embedding group joins the first and last stage only
        assert ("embed" in res["pp4"]["none"]) == (rank in (1, 2))
        assert (res["pp4"]["embed_timeout"] == 1234.0) == (rank in (0, 3))
        if rank in (0, 3):
            assert res["pp4"]["ranks"]["embed"] == [0, 3]


def test_group_maker_reuses_known_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process, torch.distributed faked: new groups only for unseen sets of size > 1."""
    import torch.distributed as dist

    made: list[list[int]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: made.append(ranks) or tuple(ranks))
    maker = GroupMaker(rank=1)
    maker.register([[0, 1, 2, 3]], "WORLD")  # type: ignore[arg-type]
    maker.register([[0, 2], [1, 3]], "DP")  # type: ignore[arg-type]
    assert maker.partition([[0, 1, 2, 3]]) == "WORLD"
    assert maker.partition([[2, 0], [3, 1]]) == "DP"  # order inside a set does not matter
    assert maker.partition([[0], [1], [2], [3]]) is None  # alone: no group
    assert maker.partition([[0, 1], [2, 3]]) == (0, 1)
    assert maker.partition([[0, 1], [2, 3]]) == (0, 1)  # asked again: the same group
    assert maker.partition([[0, 3]]) is None  # not a member
    assert made == [[0, 1], [2, 3], [0, 3]] and maker.made == 3
    own = maker.partition([[0, 1], [2, 3]], share=False)  # groups of its own
    assert own == (0, 1) and made[-2:] == [[0, 1], [2, 3]]
    assert maker.partition([[1, 3]]) == "DP"  # the shared ones are still handed out


@pytest.mark.parametrize(("tied", "schedule", "v", "asked"), [
    (True, "1f1b", 1, True),  # both ends keep the table: the group is made
    (False, "1f1b", 1, False),  # untied: no communicator for nothing
    (True, "zbv", 2, False),  # a V puts both ends on rank 0: one table, no group
])
def test_pipeline_asks_for_the_embedding_group_only_when_it_uses_it(
        tied: bool, schedule: str, v: int, asked: bool) -> None:
    """Every rank of a pipeline makes the same call (whichever stage it holds): the group is
    made collectively, and only when the table is on two ranks."""
    from dataclasses import replace

    from meshlm.distributed.comm import Comm
    from meshlm.distributed.mesh import Mesh
    from meshlm.distributed.spec import attach_specs
    from meshlm.layout import Layout
    from meshlm.models import build_model
    from meshlm.models.presets import PRESETS
    from meshlm.parallel.pipeline import PipelineModel

    class Recorder(Comm):  # (one process: no groups; counts the pipeline's requests)
        calls = 0

        def build_embed_group(self) -> None:
            self.calls += 1

    cfg = replace(PRESETS["tiny"], tie_embeddings=tied, n_layers=4)
    for rank in range(2):
        comm = Recorder(Mesh(Layout()))
        model = build_model(cfg, 0)
        attach_specs(model, comm.mesh)
        PipelineModel(model, rank, 2, v, schedule=schedule, comm=comm)
        assert comm.calls == int(asked), (rank, comm.calls)


def test_a_group_made_later_reaches_the_flight_recorder(tmp_path) -> None:  # noqa: ANN001
    """The embedding group is made after the flight recorder opened: its ranks are written to
    the recorder's metadata then, so a stall diagnosis knows the peers of a tied all-reduce."""
    import json

    from meshlm.distributed.comm import Comm
    from meshlm.distributed.flight import FlightRecorder
    from meshlm.distributed.mesh import Mesh
    from meshlm.layout import Layout

    class Later(Mesh):  # (one process: the group's ranks as a two-stage pipeline would have)
        made = False

        def build_embed_group(self) -> None:
            self.made = True

        def group_ranks(self) -> dict[str, list[int]]:
            return {"pp": [0, 1], **({"embed": [0, 1]} if self.made else {})}

    comm = Comm(Later(Layout()))
    comm.flight = FlightRecorder(tmp_path, 0, 2, 8, {"pp": 0}, comm.mesh.group_ranks())
    meta = tmp_path / "rank_00000.meta.json"
    assert "embed" not in json.loads(meta.read_text())["groups"]
    comm.build_embed_group()
    assert json.loads(meta.read_text())["groups"] == {"pp": [0, 1], "embed": [0, 1]}
