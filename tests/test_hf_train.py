"""Hugging Face interop through the trainer and the CLI: import into a tp=2 pp=2 run, export
with ``meshlm convert`` (Llama and Mixtral) and load in transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from meshlm import load_model  # noqa: E402
from meshlm.config import load_config  # noqa: E402
from meshlm.data import build_data  # noqa: E402
from meshlm.data.sampler import StepSampler  # noqa: E402
from meshlm.testing import HANG_GUARD_S, relative_difference, run_world  # noqa: E402
from meshlm.train.trainer import train  # noqa: E402


def _quiet(_m: str) -> None:
    pass


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=HANG_GUARD_S)


def train_losses(args: list[str]) -> dict[int, float]:
    return train(load_config(None, args), log=_quiet, progress=False).losses


def test_import_into_tp2_pp2_first_loss_equals_hf(tiny_args: list[str], tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=520, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir, safe_serialization=True)
    args = tiny_args + [f"--model.init_from={hf_dir}", "--train.steps=1",
                        "--train.global_batch=4", "--train.micro_batch=2",
                        "--parallel.tp=2", "--parallel.pp=2", "--train.eval_every=0"]
    loss = run_world(4, train_losses, args)[0][1]
    # the same batch through the Hugging Face model
    cfg = load_config(None, args)
    data = build_data(cfg.data, log=_quiet)
    sampler = StepSampler(data.train_tokens, cfg.data.seq_len, cfg.train.global_batch,
                          cfg.train.seed)
    (inputs, targets), = sampler.rank_micro_batches(1, 0, 1, cfg.train.global_batch)
    with torch.no_grad():
        logits = hf(inputs.long()).logits
    ref = float(F.cross_entropy(logits.flatten(0, 1), targets.long().flatten()))
    assert abs(loss - ref) / ref < 1e-5, (loss, ref)


@pytest.mark.parametrize("moe", [False, True])
def test_convert_to_hf_loads_in_transformers(tiny_args: list[str], tmp_path: Path,
                                             moe: bool) -> None:
    extra = (["--model.preset=tiny-moe", "--model.moe_shared_experts=0"] if moe else [])
    train_losses(tiny_args + extra + ["--train.steps=2"])
    out = tmp_path / "hf"
    res = _cli("convert", str(tmp_path / "run"), "--to-hf", str(out), "--max-shard-mb=0.1")
    assert res.returncode == 0, res.stderr
    assert (out / "model.safetensors.index.json").is_file()  # sharded above the size
    cls = transformers.MixtralForCausalLM if moe else transformers.LlamaForCausalLM
    hf = cls.from_pretrained(out).eval()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = load_model(tmp_path / "run")(ids)
        theirs = hf(ids).logits
        back = load_model(out)(ids)  # and back through meshlm's HF reader
    assert relative_difference(theirs, ours) < 1e-5
    assert relative_difference(back, ours) < 1e-6
    # a second convert never overwrites
    again = _cli("convert", str(tmp_path / "run"), "--to-hf", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr
