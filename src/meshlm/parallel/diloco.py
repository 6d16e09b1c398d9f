"""DiLoCo across islands: inner steps alone, then an outer Nesterov step on the mean
pseudo-gradient (Douillard et al. 2023), optionally streamed in fragments (Douillard et al. 2025).

``parallel.islands`` = K copies of the inner layout (any dp/zero x tp x pp x cp x ep mesh) train
on disjoint shares of every global batch. Each island takes ``diloco.inner_steps`` = H AdamW
steps on its own; then, for every parameter range a rank owns (its engine's
:meth:`~meshlm.parallel.engine.Engine.owned` shards: a ZeRO shard of a tp slice of a pipeline
stage's layer), the pseudo-gradient ``Δ = θ_ref − θ`` is averaged over the ranks holding the same
shard in the other islands (the ``island`` axis) and the outer optimizer -- SGD with Nesterov
momentum, ``outer_lr`` and ``outer_momentum`` -- moves the reference ``θ_ref``, which every island
then continues from. Shards are never gathered: a rank sends exactly what it owns.

Streaming (``diloco.fragments`` = F): the layers are cut into F contiguous groups (the
embedding with the first, the final norm and head with the last); fragment p synchronises at the
steps ``t`` with ``t mod H = (p + 1) H / F mod H``, so each fragment still meets every H steps but
no step sends more than about 1/F of the model. The last step of a run synchronises every
fragment, so a run ends with one model.

Communication per rank at a synchronisation of fragment p: one all-reduce over ``island`` of
its owned elements of p in ``diloco.reduce_dtype`` (bytes = elements x dtype size), plus one
all-reduce of three float64 scalars over ``island`` (the round's loss, the stop flag) and one
over ``inner`` (the pseudo-gradient norm, bytes sent). Nothing crosses islands between
synchronisations but one float64 when a checkpoint is written (the round's losses so far). Memory per rank: the reference weights and the outer momentum of its owned
ranges, fp32 (8 bytes per owned parameter), plus one fragment's flat pseudo-gradient during a
synchronisation. Both are saved in checkpoints, sharded like the weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..config import DilocoSection
from ..distributed.comm import Comm
from ..distributed.spec import first_copy
from ..precision import DTYPES
from .engine import Engine, Owned

_LAYER = re.compile(r"^layers\.(\d+)\.")


def fragment_of(name: str, n_layers: int, fragments: int) -> int:
    """Fragment of a parameter (by its one-process name): layer i is in ``i F / n_layers``;
    the embedding goes with the first fragment, everything after the layers with the last."""
    m = _LAYER.match(name)
    if m:
        return int(m.group(1)) * fragments // n_layers
    return 0 if name.startswith("tok_embeddings.") else fragments - 1


def sync_fragments(step: int, inner_steps: int, fragments: int, last_step: int) -> list[int]:
    """Fragments that synchronise after optimizer step ``step`` (1-based); all on the last."""
    if step == last_step:
        return list(range(fragments))
    return [p for p in range(fragments)
            if step % inner_steps == (p + 1) * inner_steps // fragments % inner_steps]


def outer_update(ref: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float,
                 mu: float) -> None:
    """One outer step on flat fp32 tensors: torch's ``SGD(lr, momentum=mu, nesterov=mu > 0)``
    with ``delta`` as the gradient (the buffer starts at zero, so its first value is delta)."""
    momentum.mul_(mu).add_(delta)
    ref.sub_(delta.add(momentum, alpha=mu) if mu > 0 else momentum, alpha=lr)


@dataclass
class _Fragment:
    """One fragment of this rank's owned ranges: indices into ``engine.owned()`` and their
    reference weights and outer momentum, flat (ranges concatenated in that order)."""

    owned: list[int]
    ref: torch.Tensor
    momentum: torch.Tensor
    outer_steps: int = 0


class Diloco:
    """This rank's outer state and synchronisations (see module docstring)."""

    def __init__(self, engine: Engine, comm: Comm, cfg: DilocoSection, n_layers: int) -> None:
        self.engine, self.comm, self.cfg = engine, comm, cfg
        self.islands = comm.size("island")
        self.dtype = DTYPES[cfg.reduce_dtype]
        self.owned: list[Owned] = engine.owned()
        members: list[list[int]] = [[] for _ in range(cfg.fragments)]
        for i, o in enumerate(self.owned):
            members[fragment_of(o.spec.name, n_layers, cfg.fragments)].append(i)
        self.fragments = []
        for idx in members:
            ref = self._current(idx)
            self.fragments.append(_Fragment(idx, ref, torch.zeros_like(ref)))
        self.bytes_total = 0  # bytes this island sent across islands (all its ranks)
        # the island's losses since the last synchronisation (sum, count)
        self.loss_sum, self.loss_count = 0.0, 0

    # ------------------------------------------------------------------ helpers
    def _current(self, idx: list[int]) -> torch.Tensor:
        """This rank's current weights of owned ranges ``idx``, flat fp32 (a copy)."""
        dev = self.comm.mesh.device()
        if not idx:
            return torch.zeros(0, dtype=torch.float32, device=dev)
        return torch.cat([self.owned[i].weight.detach().reshape(-1).float() for i in idx])

    def _install(self, idx: list[int], flat: torch.Tensor) -> None:
        """Write ``flat`` into the owned ranges ``idx`` (the inverse of ``_current``)."""
        at = 0
        for i in idx:
            w = self.owned[i].weight
            n = w.numel()
            w.copy_(flat[at:at + n].view_as(w))
            at += n

    def shard_bytes(self) -> int:
        """Bytes this rank sends across islands when every fragment synchronises."""
        return sum(f.ref.numel() for f in self.fragments) * self.dtype.itemsize

    def describe(self) -> str:
        g = self.cfg
        return (f"diloco: {self.islands} islands, {g.inner_steps} inner steps, outer lr "
                f"{g.outer_lr:g}, momentum {g.outer_momentum:g}"
                + (" (Nesterov)" if g.outer_momentum > 0 else "")
                + f", {g.fragments} fragment(s), all-reduce in {g.reduce_dtype}: "
                f"{self.shard_bytes() / 2**20:,.2f} MiB per rank per round")

    # ------------------------------------------------------------------ the round
    def note_loss(self, loss: float) -> None:
        self.loss_sum += loss
        self.loss_count += 1

    def due(self, step: int, last_step: int) -> list[int]:
        return sync_fragments(step, self.cfg.inner_steps, self.cfg.fragments, last_step)

    def sync(self, step: int, fragments: list[int], stop: bool) -> dict[str, Any]:
        """Synchronise ``fragments`` after ``step`` (collective over ``island`` and ``inner``);
        returns the metrics of the synchronisation, ``stop`` agreed by every island under
        ``"_stop"``."""
        mesh = self.comm.mesh
        sq = torch.zeros((), dtype=torch.float64, device=mesh.device())
        sent = 0
        for p in fragments:
            frag = self.fragments[p]
            frag.outer_steps += 1
            if not frag.owned:  # (a pipeline stage without layers of this fragment)
                continue
            delta = frag.ref - self._current(frag.owned)
            wire = delta if self.dtype == torch.float32 else delta.to(self.dtype)
            self.comm.all_reduce(wire, "island")
            sent += wire.numel() * wire.element_size()
            if wire is not delta:
                delta.copy_(wire)
            delta.div_(self.islands)
            at = 0
            for i in frag.owned:  # each element once in the island's norm
                n = self.owned[i].weight.numel()
                if first_copy(self.owned[i].spec, mesh):
                    sq += delta[at:at + n].double().pow(2).sum()
                at += n
            outer_update(frag.ref, frag.momentum, delta, self.cfg.outer_lr,
                         self.cfg.outer_momentum)
            self._install(frag.owned, frag.ref)
        self.engine.sync_held()
        inner = self.comm.reduce_scalars([float(sq), float(sent)], "inner")
        mean_loss = self.loss_sum / max(1, self.loss_count)
        across = self.comm.reduce_scalars([mean_loss, float(stop)], "island", op="sum")
        self.loss_sum, self.loss_count = 0.0, 0
        self.bytes_total += int(inner[1])
        return {"outer_step": max(self.fragments[p].outer_steps for p in fragments),
                "outer_fragments": fragments, "outer_loss": across[0] / self.islands,
                "pseudo_grad_norm": inner[0] ** 0.5, "island_bytes": int(inner[1]),
                "island_bytes_total": self.bytes_total, "_stop": across[1] > 0}

    # ------------------------------------------------------------------ checkpoints
    def outer_pieces(self) -> dict[int, dict[str, torch.Tensor]]:
        """Index in ``engine.owned()`` -> its reference weights and outer momentum (1-D views)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for frag in self.fragments:
            at = 0
            for i in frag.owned:
                n = self.owned[i].weight.numel()
                out[i] = {"weight": frag.ref[at:at + n], "outer_momentum": frag.momentum[at:at + n]}
                at += n
        return out

    def state_dict(self) -> dict[str, Any]:
        """Outer round counters, and the losses of the round so far summed over every island
        (collective over ``island``: one float64; rank 0 writes one ``trainer.json`` for all
        islands, and a resumed island continues from their mean)."""
        total = self.comm.reduce_scalars([self.loss_sum], "island", op="sum")[0]
        return {"outer_steps": [f.outer_steps for f in self.fragments],
                "bytes_total": self.bytes_total, "round_loss_sum": total,
                "round_loss_count": self.loss_count}

    def load(self, read: Any, state: dict[str, Any] | None) -> None:
        """Reference weights and momentum from a checkpoint: ``read(kind, owned)`` returns the
        1-D values of an owned range (None when the checkpoint has no such kind: a run without
        islands, whose weights become the reference and whose momentum starts at zero)."""
        for frag in self.fragments:
            for kind, flat in (("weight", frag.ref), ("outer_momentum", frag.momentum)):
                parts = [read(kind, self.owned[i]) for i in frag.owned]
                if any(p is None for p in parts):
                    if kind == "weight":
                        flat.copy_(self._current(frag.owned))
                    else:
                        flat.zero_()
                elif parts:
                    flat.copy_(torch.cat(parts))
        state = state or {}
        for f, n in zip(self.fragments, state.get("outer_steps", []), strict=False):
            f.outer_steps = int(n)
        self.bytes_total = int(state.get("bytes_total", 0))
        self.loss_sum = float(state.get("round_loss_sum", 0.0)) / self.islands
        self.loss_count = int(state.get("round_loss_count", 0))
