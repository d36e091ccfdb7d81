"""The running batch's KV context, measured: what vLLM's gauges say each sequence holds (pure).

The model derives the context a decode step reads from the length distribution,
``P + E[G²]/(2·E[G])`` (:meth:`controller.model.Workload.mean_context_tokens`). That takes
prompt and generated lengths as independent; in a mix where they are not (long retrieval
prompts with short answers next to chat), the running batch is mostly the long generations'
requests, and the formula puts the context hundreds of tokens off. vLLM measures the batch
directly: ``vllm:kv_cache_usage_perc`` (a fraction, despite the name) of the cache's
``kv_cache_size_tokens`` is in use by ``vllm:num_requests_running`` sequences. Both are gauges,
so a window's means are taken: mean tokens in use / mean sequences running is the context per
running sequence weighted by time in the batch, the residence-weighted context itself.

Two things the blocks hide are put back:

* Block rounding: a sequence's last block is on average half empty (``(block_size − 1)/2``
  tokens allocated but not read).
* Prefix caching: a prompt prefix cached by several running requests is one set of blocks, but
  each request's attention reads it. Adding the prompt tokens served from the cache per request
  is the upper bound of what sharing hides (a request whose cached prefix nobody else runs is
  counted in full already), so the context is never understated.
"""

from __future__ import annotations

import math

# Below this mean batch the window saw too few sequences for their context to mean anything.
MIN_RUNNING = 1.0


def running_context_tokens(
    kv_usage: float,
    kv_cache_tokens: float,
    running: float,
    block_size: int,
    cached_prompt_tokens: float = 0.0,
) -> float | None:
    """KV tokens the average running sequence's decode step reads; None when unmeasurable.

    ``kv_usage``: mean ``vllm:kv_cache_usage_perc`` over the window (0–1). ``kv_cache_tokens``:
    the cache's capacity (``vllm:cache_config_info`` num_gpu_blocks × block_size).
    ``running``: mean ``vllm:num_requests_running`` over the same window.
    ``cached_prompt_tokens``: prompt tokens per request served from the prefix cache
    (Δ``vllm:prompt_tokens_cached_total`` / Δrequests), 0 without prefix caching.
    """
    values = (kv_usage, kv_cache_tokens, running, cached_prompt_tokens)
    if not all(math.isfinite(v) for v in values):
        return None
    if running < MIN_RUNNING or kv_cache_tokens <= 0 or not 0.0 < kv_usage <= 1.0 or block_size < 1:
        return None
    held = kv_usage * kv_cache_tokens / running - 0.5 * (block_size - 1)
    return max(held, 1.0) + max(cached_prompt_tokens, 0.0)
