"""Bad input of the frontier MoE keys is one ``meshlm: error:`` line before any worker starts:
groups that do not divide the experts, more groups chosen than there are, MLA heads tp does not
split, rotary parts that cannot rotate, an MTP depth with too few tokens."""

from __future__ import annotations

import pytest

from meshlm.cli import main

MLA = ["--model.kv_lora_rank=16", "--model.qk_nope_head_dim=16", "--model.qk_rope_head_dim=8",
       "--model.v_head_dim=16", "--model.n_heads=6", "--model.n_kv_heads=6"]


@pytest.mark.parametrize("args, message", [
    (["--model.preset=tiny-moe", "--model.moe_n_group=3"],
     "model.moe_n_group=3 does not divide model.moe_experts=4"),
    (["--model.preset=tiny-moe", "--model.moe_n_group=2", "--model.moe_topk_group=3"],
     "model.moe_topk_group=3 exceeds model.moe_n_group=2"),
    (["--model.preset=tiny-moe", "--model.moe_n_group=4", "--model.moe_topk_group=1"],
     "model.moe_topk=2 exceeds the experts of model.moe_topk_group=1 groups (1)"),
    (["--model.preset=tiny-moe", "--model.moe_score=tanh"], "model.moe_score='tanh' is not one"),
    (["--model.preset=tiny", *MLA, "--parallel.tp=4"], "parallel.tp=4 does not divide "
                                                       "model.n_heads=6"),
    (["--model.preset=tiny", "--model.kv_lora_rank=16"],
     "model.qk_nope_head_dim=0 must be positive with multi-head latent attention"),
    (["--model.preset=tiny", *MLA, "--model.qk_rope_head_dim=7"],
     "model.qk_rope_head_dim=7 must be even for rotary embeddings"),
    (["--model.preset=tiny", "--model.q_lora_rank=8"],
     "model.q_lora_rank=8 needs multi-head latent attention"),
    (["--model.preset=tiny", "--model.rope_factor=4"],
     "model.rope_factor=4.0 needs model.rope_original_max_len"),
    (["--model.preset=tiny", "--model.mtp_depth=3", "--data.seq_len=4"],
     "data.seq_len=4 leaves no target for multi-token prediction depth model.mtp_depth=3"),
])
def test_bad_frontier_input_is_one_line(args: list[str], message: str, tmp_path,  # noqa: ANN001
                                        capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    assert main(["train", *args, "--parallel.dp=2", f"--run.dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshlm: error: ") and message in err[0], err
    assert not run.exists()  # nothing written, no worker started
