"""The running batch's KV context from vLLM's gauges, summed over engines (both sources use it).

``vllm:cache_config_info`` says each engine's cache capacity in its labels (``num_gpu_blocks`` ×
``block_size``); ``vllm:kv_cache_usage_perc`` the fraction of it in use. With several engines
(data parallel) the tokens in use add up, and so do the running sequences:
context = Σ usage_e × capacity_e / Σ running_e (:func:`controller.occupancy.running_context_tokens`
does the rest). Anything unreadable makes the context ``None``, never a failed observation:
old servers and the simulator do not export these series, and the model then falls back on the
length distribution.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from controller.occupancy import running_context_tokens

USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PROMPT_CACHED = "vllm:prompt_tokens_cached"
# Far past any GPU's KV cache (a trillion tokens): a capacity above it is a garbled label, and
# its product with the usage would overflow what the model computes.
MAX_KV_CACHE_TOKENS = 1e12


@dataclass(frozen=True)
class CacheCapacity:
    """One engine's KV cache, from ``vllm:cache_config_info``'s labels."""

    tokens: float
    block_size: int


def cache_capacity(labels: Mapping[str, str]) -> CacheCapacity | None:
    """``num_gpu_blocks`` × ``block_size``; None when a label is absent, not a positive integer
    (vLLM writes ``"None"`` for what it has not decided), or the product is past
    :data:`MAX_KV_CACHE_TOKENS`."""
    try:
        blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError, TypeError):
        return None
    if blocks <= 0 or block_size <= 0 or blocks * block_size > MAX_KV_CACHE_TOKENS:
        return None
    return CacheCapacity(float(blocks * block_size), block_size)


def prefix_caching(labels: Mapping[str, str]) -> bool | None:
    """``enable_prefix_caching`` (vLLM writes its config's Python values: ``"True"``/``"False"``);
    None when absent or anything else."""
    return {"true": True, "false": False}.get(labels.get("enable_prefix_caching", "").lower())


def all_prefix_caching(said: list[bool | None]) -> bool | None:
    """Several engines' labels as one: on only when every engine that says is on; None when none says."""
    known = [x for x in said if x is not None]
    return all(known) if known else None


@dataclass(frozen=True)
class HeldTokens:
    """KV tokens in use, summed over engines, with the cache they are a part of."""

    tokens: float
    capacity_tokens: float
    block_size: int


def held_tokens(usage: Mapping[Hashable, float], capacity: Mapping[Hashable, CacheCapacity]) -> HeldTokens | None:
    """Σ usage_e × capacity_e over the engines in ``usage`` (keyed like ``capacity``).

    None when there is no usage, an engine's usage is not a fraction in [0, 1] (garbage), or an
    engine has no capacity. A ``capacity`` keyed ``""`` (a config series without an ``engine``
    label) stands for every engine.
    """
    if not usage:
        return None
    tokens = total = 0.0
    block_size = 0
    for key, u in usage.items():
        cap = capacity.get(key) or capacity.get("")
        if cap is None or not math.isfinite(u) or not 0.0 <= u <= 1.0:
            return None
        tokens += u * cap.tokens
        total += cap.tokens
        block_size = max(block_size, cap.block_size)  # engines of one server share it
    return HeldTokens(tokens, total, block_size)


def context_tokens(held: HeldTokens | None, running: float | None, cached_prompt_tokens: float | None) -> float | None:
    """The average running sequence's KV context (occupancy.running_context_tokens), or None."""
    if held is None or running is None or cached_prompt_tokens is None:
        return None
    return running_context_tokens(
        held.tokens / held.capacity_tokens, held.capacity_tokens, running, held.block_size, cached_prompt_tokens
    )
