"""Rotary tables: plain RoPE (Su et al. 2021) and YaRN's stretched context (Peng et al. 2023).

:func:`rope_tables` gives the cos and sign-folded sin tables ``apply_rope`` (``models/llama.py``)
multiplies by: the rotate-half convention, element i paired with i + d/2, the angle of position
p and pair i ``p * inv_freq[i]``. Plain RoPE has ``inv_freq[i] = theta^(-2i/d)``.

YaRN (``model.rope_factor`` = f > 1, a model trained at ``model.rope_original_max_len`` = L
stretched f times; DeepSeek-V3's ``rope_scaling``, Hugging Face's ``rope_type = "yarn"``):

- frequencies that turn fewer than ``beta_slow`` times over L are interpolated (divided by f),
  those that turn more than ``beta_fast`` times are kept (extrapolated), and a linear ramp
  blends the two in between: the pair whose wavelength turns r times over L is
  ``d log(L / (2 pi r)) / (2 log theta)`` (DeepSeek's ``yarn_find_correction_range``, rounded
  outwards, clamped to [0, d - 1]); ``inv_freq = interp (1 - e) + extrap e`` with
  ``e = 1 - ramp``;
- the tables are multiplied by ``mscale(f, m) / mscale(f, m_all)``, where
  ``mscale(f, m) = 0.1 m ln f + 1`` (``yarn_get_mscale``; m = ``model.rope_mscale``,
  m_all = ``model.rope_mscale_all_dim``, 0 giving 1), so each rotated query-key product grows by
  its square;
- an attention layer may also multiply its softmax scale by ``mscale(f, m_all)^2``
  (:func:`score_scale`), as DeepSeek-V3's does: with m = m_all (V3's published 1.0, 1.0) the
  tables are unscaled and the whole correction is on the scores. Grouped-query attention takes
  the tables only, as Hugging Face's Llama / Qwen YaRN does.

Tables are computed in float64 and stored in fp32 (one rounding per entry). No communication;
memory: two (max_seq_len, d) fp32 tables per model.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 mscale ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, theta: float,
                          original_max_len: int) -> tuple[int, int]:
    """(low, high): the rotary pairs between which YaRN's ramp runs (DeepSeek's
    ``yarn_find_correction_range``): pair ``i`` turns ``L / (2 pi theta^(2i/d))`` times over
    the original context L; ``beta_fast`` turns bound the kept pairs, ``beta_slow`` the
    interpolated ones."""

    def pair(turns: float) -> float:
        return dim * math.log(original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    return max(math.floor(pair(beta_fast)), 0), min(math.ceil(pair(beta_slow)), dim - 1)


def inverse_frequencies(dim: int, theta: float, factor: float = 1.0, original_max_len: int = 0,
                        beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """(dim / 2,) float64 angle per position of each rotary pair; YaRN's blend when
    ``factor`` > 1 (module docstring)."""
    extrap = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if factor <= 1:
        return extrap
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, theta, original_max_len)
    span = (high - low) or 0.001  # (DeepSeek's guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / span).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolated (fast pairs), 0: interpolated (slow pairs)
    return extrap / factor * (1 - keep) + extrap * keep


def rope_tables(head_dim: int, max_seq_len: int, theta: float, *, factor: float = 1.0,
                original_max_len: int = 0, beta_fast: float = 32.0, beta_slow: float = 1.0,
                mscale: float = 1.0, mscale_all_dim: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin tables, each (max_seq_len, head_dim) fp32, for ``apply_rope``.

    The rotate-half convention pairs element i with i + hd/2. The sin table's first half is
    negated (``[-sin, sin]``) so that ``rotate_half(x) * sin == swap_halves(x) * signed_sin``:
    rotation then needs no negation pass (exact: only a sign moves). ``factor`` > 1: YaRN's
    frequencies and table scale (module docstring).
    """
    inv_freq = inverse_frequencies(head_dim, theta, factor, original_max_len, beta_fast,
                                   beta_slow)
    pos = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(pos, inv_freq)  # (S, hd/2)
    scale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    return torch.cat([cos, cos], dim=-1).float(), torch.cat([-sin, sin], dim=-1).float()


def model_rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of a model: ``cfg.rope_dim`` wide (the rotated features of a query/key head),
    ``cfg.max_seq_len`` positions, YaRN when ``cfg.rope_factor`` > 1."""
    return rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, factor=cfg.rope_factor,
                       original_max_len=cfg.rope_original_max_len,
                       beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow,
                       mscale=cfg.rope_mscale, mscale_all_dim=cfg.rope_mscale_all_dim)


def score_scale(cfg: ModelConfig) -> float:
    """What an attention layer that corrects its scores for YaRN (DeepSeek-V3's) multiplies
    its softmax scale by: ``mscale(f, m_all)^2`` (1 without YaRN)."""
    return yarn_get_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


__all__ = ["inverse_frequencies", "model_rope_tables", "rope_tables", "score_scale",
           "yarn_correction_range", "yarn_get_mscale"]
