"""Summarise ``benchmarks/pipeline.py --profile DIR``: per implementation, round and rank, the
seconds its steps spent in the main kernels and waiting.

    python benchmarks/profile_summary.py DIR

Columns: autograd backward, linear forward, attention, cross-entropy, ``torch.cat``, waits
on point-to-point handles and waits inside collectives (all-reduce, broadcast, barrier,
all-gather). Reads the ``.pstat`` files only: no communication, memory of one profile at a
time.
"""

from __future__ import annotations

import argparse
import pstats
from pathlib import Path

KERNELS = {"backward": "run_backward", "linear": "_nn.linear",
           "attention": "scaled_dot_product", "loss": "cross_entropy_loss", "cat": "torch.cat"}
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather_single", "recv_object_list")


def summarise(path: Path) -> dict[str, float]:
    """Seconds (own time) per kernel kind and per kind of wait in one profile."""
    out = dict.fromkeys([*KERNELS, "p2p wait", "collective wait"], 0.0)
    for (_file, _line, name), (_cc, _nc, own, _cum, callers) in pstats.Stats(
            str(path)).stats.items():
        for kind, key in KERNELS.items():
            if key in name:
                out[kind] += own
        if "c10d.wait" in name:  # a handle's wait, by who waited
            for (_f, _l, caller), stats in callers.items():
                out["collective wait" if caller in COLLECTIVES else "p2p wait"] += stats[2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    folder = ap.parse_args().folder
    files = sorted(folder.glob("*.pstat"))
    if not files:
        ap.error(f"{folder}: no .pstat files (run benchmarks/pipeline.py --profile {folder})")
    kinds = [*KERNELS, "p2p wait", "collective wait"]
    print("| profile | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for f in files:
        row = summarise(f)
        print(f"| {f.stem} | " + " | ".join(f"{row[k]:.3f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
