"""Step costs for the tick engine from the independent ground truth (the GPU roofline).

:class:`TruthCosts` implements the engine's ``StepCosts`` protocol with
:func:`controller.sim.stepsim.step_time_s` — the very function the step-level simulator charges
per step — so the tick engine and the step simulator price a step the same way:

* a decode step without SD: the target over one token per sequence;
* a verify step with SD: the target over γ+1 tokens per sequence (γ+1 sampled), the draft over
  the same tokens, γ−1 more single-token draft passes, and the rejection sampler;
* a prompt chunk: what the step costs with the chunk minus without it — the target's and, with
  SD, the draft's pass over the prompt tokens (the draft prefills every prompt), plus the
  prompts that finish prefilling joining the draft passes.

KV capacity comes from :func:`controller.sim.gpu.kv_capacity_tokens` (with the draft's weights
and KV when SD is on). Nothing here reads the controller's latency model or a calibration: the
decision benchmark grades the controller against these costs.

The engine asks for costs once per tick with fractional batch sizes and aggregate context; the
answers are memoised on a coarse grid (integer batch, context per sequence and prompt length
to ~2 %), which keeps a day of ticks to seconds.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from controller.sim import gpu as g
from controller.sim.stepsim import ServerSpec, step_time_s

_LOG_STEPS = 50.0  # grid of context / prompt lengths: exp(k/50), i.e. 2 % apart


def _bucket(x: float) -> int:
    return round(math.log(max(x, 0.0) + 16.0) * _LOG_STEPS)


def _unbucket(k: int) -> float:
    return max(math.exp(k / _LOG_STEPS) - 16.0, 0.0)


def _round_chunk(tokens: int) -> int:
    """Chunk sizes on a memo grid: exact up to 64 tokens, then 1/32 steps (3 %)."""
    if tokens <= 64:
        return tokens
    step = 1 << max(0, tokens.bit_length() - 6)
    return max(step, round(tokens / step) * step)


class TruthCosts:
    """The engine's step costs on a simulated GPU (defaults: Llama-3.1-8B target, Llama-3.2-1B
    draft, H100 SXM, vLLM's max_num_seqs 256 and max_num_batched_tokens 8192)."""

    def __init__(
        self,
        target: g.ModelSpec = g.LLAMA_3_1_8B,
        draft: g.ModelSpec = g.LLAMA_3_2_1B,
        gpu: g.GpuSpec = g.H100_SXM,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        self.target, self.draft, self.gpu = target, draft, gpu
        self.max_num_seqs = int(max_num_seqs)
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.gpu_memory_utilization = gpu_memory_utilization
        self._specs: dict[int, ServerSpec] = {}
        # Per instance, so two servers never share answers.
        self._step = lru_cache(maxsize=500_000)(self._step_uncached)

    def spec(self, gamma: int) -> ServerSpec:
        """The step simulator's server for draft length ``gamma`` (0: SD off)."""
        s = self._specs.get(gamma)
        if s is None:
            s = ServerSpec(
                target=self.target,
                draft=self.draft if gamma > 0 else None,
                gpu=self.gpu,
                draft_length=gamma,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                gpu_memory_utilization=self.gpu_memory_utilization,
            )
            self._specs[gamma] = s
        return s

    @staticmethod
    def _gamma(sd) -> int:
        return int(sd.num_speculative_tokens) if sd.enabled else 0

    def _step_uncached(self, gamma: int, batch: int, ctx_key: int, chunk: int, prompt_key: int) -> float:
        """Noise-free seconds of one step: ``batch`` decoding sequences (context ``ctx_key`` each)
        plus ``chunk`` prompt tokens in prompts of ``prompt_key`` tokens (starting at context 0)."""
        spec = self.spec(gamma)
        ctx = _unbucket(ctx_key)
        per_seq = gamma + 1
        q = [np.full(batch, per_seq, dtype=np.int64)]
        c = [np.full(batch, round(ctx), dtype=np.int64)]
        sampled = [np.full(batch, per_seq, dtype=np.int64)]
        if chunk > 0:
            plen = max(1.0, _unbucket(prompt_key))
            pieces = max(1, math.ceil(chunk / plen))
            sizes = np.full(pieces, chunk // pieces, dtype=np.int64)
            sizes[: chunk - int(sizes.sum())] += 1
            q.append(sizes)
            c.append(np.zeros(pieces, dtype=np.int64))
            sampled.append(np.ones(pieces, dtype=np.int64))  # each piece taken as ending its prompt
        qa, ca, sa = np.concatenate(q), np.concatenate(c), np.concatenate(sampled)
        drafting = np.ones(qa.size, dtype=bool)
        return step_time_s(spec, qa, ca, sa, gamma > 0 and batch > 0, drafting)

    def decode_step_s(self, batch: float, ctx_tokens: float, sd) -> tuple[float, float]:
        """(seconds of one decode/verify step, tokens it computes) for ``batch`` sequences holding
        ``ctx_tokens`` of KV between them."""
        gamma = self._gamma(sd)
        b = max(1, round(batch))
        t = self._step(gamma, b, _bucket(ctx_tokens / b), 0, 0)
        return t, float(batch * (gamma + 1))

    def chunk_extra_s(
        self,
        batch: float,
        decode_tokens: float,
        chunk_tokens: float,
        sd,
        prompt_tokens: float = 0.0,
        step_chunk_tokens: float = 0.0,
    ) -> float:
        """Extra seconds steps with ``batch`` decoding sequences pay for ``chunk_tokens`` of prompt,
        each step carrying ``step_chunk_tokens`` of it (default: all in one step). The GEMMs'
        efficiency rises with their size, so 8k prompt tokens in one step cost less than in eight."""
        gamma = self._gamma(sd)
        b = max(1, round(batch))
        chunk = float(chunk_tokens)
        if chunk <= 0:
            return 0.0
        per_step = round(min(chunk, step_chunk_tokens if step_chunk_tokens > 0 else chunk))
        per_step = max(per_step, 1)
        # Attention is costed per sequence, so the decode part's context cancels in the
        # difference: a fixed one keeps the memo small.
        ck = _bucket(1024.0)
        pk = _bucket(prompt_tokens if prompt_tokens > 0 else per_step)
        one = self._step(gamma, b, ck, _round_chunk(per_step), pk) - self._step(gamma, b, ck, 0, 0)
        return max(one, 0.0) * chunk / _round_chunk(per_step)

    def kv_capacity_tokens(self, sd) -> float | None:
        """KV cache tokens of the simulated server in that mode (the draft's share taken out with SD)."""
        return float(self.spec(self._gamma(sd)).kv_tokens())
