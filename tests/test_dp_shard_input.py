"""``parallel.dp_shard`` mistakes are one ``meshlm: error:`` line before any worker starts.

A shard group that does not tile dp, hybrid sharding without ZeRO (nothing would be sharded),
an expert group that would straddle two shard groups, and a negative size each name the keys
involved; nothing is written. Both ``meshlm train`` and the planner's ``--layout`` refuse them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlm.cli import main
from meshlm.layout import Layout


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("args,message", [
    (["--parallel.dp=4", "--parallel.dp_shard=3", "--parallel.zero=3"],
     "parallel.dp_shard=3 does not divide parallel.dp=4"),
    (["--parallel.dp=4", "--parallel.dp_shard=2"],
     "parallel.dp_shard=2 < parallel.dp=4 (hybrid sharding) needs parallel.zero = 1, 2 or 3"),
    (["--parallel.dp=4", "--parallel.dp_shard=-2", "--parallel.zero=1"],
     "parallel.dp_shard=-2 must be >= 1 (or 0: all of dp)"),
    (["--parallel.dp=4", "--parallel.dp_shard=2", "--parallel.zero=1", "--parallel.ep=4",
      "--model.preset=tiny-moe"],
     "parallel.ep=4 must divide parallel.dp_shard * cp = 2 under hybrid sharding"),
])
def test_dp_shard_mistakes_are_one_line(args: list[str], message: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--model.preset=tiny", "--train.steps=2", "--train.global_batch=8",
            f"--run.dir={run_dir}", *args]
    rc, lines = _cli(argv, capsys)
    assert rc == 2, lines
    assert len(lines) == 1 and lines[0].startswith("meshlm: error:"), lines
    assert message in lines[0], lines[0]
    assert not run_dir.exists()


def test_dp_shard_equal_to_dp_is_plain_zero() -> None:
    plain, same, auto = (Layout(dp=4, zero=3, dp_shard=k) for k in (0, 4, 0))
    assert not same.hybrid and same.shard_size == plain.shard_size == 4 and same.dp_rep == 1
    assert same.describe() == plain.describe() == auto.describe()
    hybrid = Layout(dp=8, zero=2, dp_shard=2)
    assert hybrid.hybrid and hybrid.dp_rep == 4 and "dp_shard=2" in hybrid.describe()
    assert hybrid.problems(world=8) == []
