"""Acceptance arithmetic: per-token acceptance α, vLLM's acceptance rate, tokens per verify step.

Three quantities people mix up:

* ``alpha``: the probability that one drafted token is accepted, given the ones before it were
  (Leviathan et al. 2023). The latency model wants this.
* vLLM's *acceptance rate*: accepted draft tokens / draft tokens, what its counters give.
  For draft length γ it equals (E[N] − 1) / γ, and it depends on γ as well as on α.
* ``E[N]``, the mean acceptance length: tokens a sequence gains per verify step,
  E[N] = (1 − α^(γ+1)) / (1 − α), i.e. 1 + α + α² + … + α^γ.

All functions work on floats and on numpy arrays (broadcasting).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

_ALPHA_ONE = 1.0 - 1e-15  # the closed form is 0/0 at α = 1


def tokens_per_step(alpha: ArrayLike, draft_length: ArrayLike) -> np.ndarray:
    """E[N] = (1 − α^(γ+1)) / (1 − α): expected tokens per verify step; γ + 1 when α = 1.

    γ = 0 (no drafting) gives exactly 1.
    """
    a = np.clip(np.asarray(alpha, dtype=float), 0.0, 1.0)
    g = np.asarray(draft_length, dtype=float)
    near_one = a >= _ALPHA_ONE
    # (1 − α^(γ+1)) / (1 − α) through expm1: no cancellation when α is close to 1.
    with np.errstate(divide="ignore"):
        log_a = np.log(np.where(near_one, 0.5, a))
    geometric = np.expm1((g + 1.0) * log_a) / np.expm1(log_a)
    return np.where(near_one, g + 1.0, geometric)


def accepted_length(alpha: float, draft_length: float) -> float:
    """:func:`tokens_per_step` on plain floats (the model's hot path; same numerics)."""
    if alpha >= _ALPHA_ONE:
        return draft_length + 1.0
    if alpha <= 0.0:
        return 1.0
    log_a = math.log(alpha)
    return math.expm1((draft_length + 1.0) * log_a) / math.expm1(log_a)


def tokens_per_step_from_positions(position_acceptance: Sequence[float] | ArrayLike) -> float:
    """E[N] = 1 + Σ_k P(draft position k accepted), from vLLM's per-position counters.

    ``position_acceptance[k]`` = accepted_tokens_per_pos{position=k} / num_drafts. A token at
    position k is only accepted if all before it were, so the probabilities must not rise.
    """
    p = np.asarray(position_acceptance, dtype=float)
    if p.ndim != 1 or p.size == 0:
        raise ValueError("position_acceptance must be a non-empty 1-D sequence")
    if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p > 1):
        raise ValueError("position_acceptance values must be finite and within [0, 1]")
    return float(1.0 + p.sum())


def vllm_rate_from_alpha(alpha: ArrayLike, draft_length: ArrayLike) -> np.ndarray:
    """vLLM's acceptance rate (accepted / drafted tokens) for per-token α at draft length γ ≥ 1."""
    g = np.asarray(draft_length, dtype=float)
    return (tokens_per_step(alpha, g) - 1.0) / np.maximum(g, 1.0)


def mean_acceptance_length(vllm_rate: ArrayLike, draft_length: ArrayLike) -> np.ndarray:
    """E[N] from vLLM's acceptance rate: 1 + rate·γ (exact, no α needed)."""
    return 1.0 + np.asarray(vllm_rate, dtype=float) * np.asarray(draft_length, dtype=float)


def alpha_from_vllm_rate(vllm_rate: ArrayLike, draft_length: ArrayLike) -> np.ndarray:
    """Invert :func:`vllm_rate_from_alpha` for α (vectorized bisection, exact to 1e-12).

    The rate is increasing in α on [0, 1] for a fixed γ, so the inverse is unique. For γ = 1 the
    rate *is* α. Rates outside [0, 1] are clipped.
    """
    r = np.clip(np.asarray(vllm_rate, dtype=float), 0.0, 1.0)
    g = np.maximum(np.asarray(draft_length, dtype=float), 1.0)
    r, g = np.broadcast_arrays(r, g)
    lo = np.zeros(r.shape)
    hi = np.ones(r.shape)
    # 45 halvings of [0, 1] reach 3e-14; the function is smooth and monotone.
    for _ in range(45):
        mid = 0.5 * (lo + hi)
        too_low = vllm_rate_from_alpha(mid, g) < r
        lo = np.where(too_low, mid, lo)
        hi = np.where(too_low, hi, mid)
    return 0.5 * (lo + hi)


def alpha_from_positions(position_acceptance: Sequence[float] | ArrayLike) -> float:
    """Per-token α that reproduces the observed E[N] at the observed draft length.

    Used to extrapolate per-position measurements to other draft lengths.
    """
    p = np.asarray(position_acceptance, dtype=float)
    mean_len = tokens_per_step_from_positions(p)
    gamma = p.size
    return float(alpha_from_vllm_rate((mean_len - 1.0) / gamma, gamma))
