"""What one forward pass of a transformer costs on a GPU: a roofline with efficiency curves.

This is the *ground truth* of the step-level simulator (``stepsim.py``). It is derived from the
model's shapes and the GPU's datasheet only, and shares no code, formula or parameter with the
controller's latency model (``controller/model.py``) or its calibration: the controller must
discover these costs by timing requests, as it would on a real server.

Per layer, the GEMMs cost the larger of their FLOPs at an efficiency that rises with the token
count (small GEMMs and padded tiles waste tensor cores) and their bytes (weights once per pass,
plus activations) at the achievable HBM bandwidth; the two are combined with a smooth maximum
because real kernels overlap compute and memory only partly. Attention is costed per sequence
from its real context (causal triangle included), the LM head only for sampled positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cache

import numpy as np

GIB = 2**30


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of a decoder-only transformer (Llama-style: GQA attention, gated MLP)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    bytes_per_param: int = 2  # bf16
    bytes_per_kv: int = 2  # bf16 KV cache

    @property
    def layer_params(self) -> int:
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        attn = self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return attn + mlp

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params + embed * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.bytes_per_kv


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet numbers plus what a serving framework achieves on it."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    gemm_eff_small: float = 0.25  # fraction of peak for tiny GEMMs (few tokens)
    gemm_eff_large: float = 0.50  # ... for large GEMMs (thousands of tokens), end to end
    gemm_eff_tokens: float = 1500.0  # token scale over which the efficiency rises
    tile_tokens: int = 64  # GEMM rows are padded to whole tiles
    attn_eff: float = 0.40  # fraction of peak flash attention reaches
    hbm_eff: float = 0.85  # fraction of the datasheet bandwidth streaming kernels reach
    overlap_p: float = 4.0  # smooth max (c^p + m^p)^(1/p): compute and memory overlap partly
    launch_overhead_s: float = 0.3e-3  # per forward pass (kernel launches, graph replay)
    step_overhead_s: float = 0.5e-3  # per engine step (scheduler, sampler, output processing)
    per_seq_overhead_s: float = 20e-6  # per scheduled sequence per engine step (CPU bookkeeping)


H100_SXM = GpuSpec(name="H100-SXM-80GB", peak_flops=989e12, hbm_bytes_per_s=3.35e12, memory_bytes=80 * GIB)
# Another GPU, for a calibration measured elsewhere (bench/bench_miscalibrated.py): datasheet
# numbers only, the same efficiencies.
A100_SXM = GpuSpec(name="A100-SXM-80GB", peak_flops=312e12, hbm_bytes_per_s=2.039e12, memory_bytes=80 * GIB)
# A second truth for the fidelity bench (bench_fidelity.py --truth a100-coarse), held out from
# the model's development: another GPU, GEMMs padded to 128-token tiles (a coarser staircase
# than the H100's 64), a slower scheduler and more per-sequence bookkeeping.
A100_COARSE = replace(
    A100_SXM,
    name="A100-SXM-80GB (128-token tiles, slower host)",
    tile_tokens=128,
    gemm_eff_large=0.6,
    launch_overhead_s=0.4e-3,
    step_overhead_s=0.8e-3,
    per_seq_overhead_s=30e-6,
)
# A third truth (bench_fidelity.py --truth l40s): a 48 GB card with GDDR6, a quarter of the
# H100's bandwidth and a third of its compute (datasheet: 362 TFLOP/s dense bf16, 864 GB/s).
L40S = replace(H100_SXM, name="L40S-48GB", peak_flops=362e12, hbm_bytes_per_s=0.864e12, memory_bytes=48 * GIB)
# A fourth truth (bench_fidelity.py --truth h200-smooth), held out from the model's development:
# an H200's datasheet (the H100's compute, 4.8 TB/s, 141 GB) with GEMMs that are not padded to
# tiles (no staircase for the calibration to find), efficiency that saturates at fewer tokens,
# compute and memory overlapping less, and a faster host.
H200_SMOOTH = replace(
    H100_SXM,
    name="H200-141GB (no GEMM tiles, another efficiency ramp)",
    hbm_bytes_per_s=4.8e12,
    memory_bytes=141 * GIB,
    tile_tokens=1,
    gemm_eff_small=0.3,
    gemm_eff_large=0.55,
    gemm_eff_tokens=800.0,
    overlap_p=3.0,
    step_overhead_s=0.4e-3,
    per_seq_overhead_s=15e-6,
)
LLAMA_3_1_8B = ModelSpec(
    name="Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256
)
LLAMA_3_2_1B = ModelSpec(
    name="Llama-3.2-1B",
    layers=16,
    hidden=2048,
    heads=32,
    kv_heads=8,
    head_dim=64,
    intermediate=8192,
    vocab=128256,
    tied_embeddings=True,
)


@dataclass(frozen=True, eq=False)
class Seqs:
    """The sequences of one forward pass (numpy int arrays, one entry per sequence).

    ``sampled_tokens`` is the number of positions sent through the LM head: 1 for a decode or
    a prompt's last chunk, γ+1 for a verify, 0 for a prefill chunk that does not end the prompt.
    """

    query_tokens: np.ndarray
    context_tokens: np.ndarray  # tokens already in the KV cache before this pass
    sampled_tokens: np.ndarray | None = field(default=None)  # None: one per sequence


@dataclass(frozen=True)
class _Consts:
    """Per (model, gpu) constants, computed once."""

    layer_weight_bytes: float
    act_bytes_per_token: float  # per layer: activations read and written by the GEMMs
    gemm_flops_per_token: float  # per layer
    attn_flops_per_key: float  # per layer, per (query, key) pair: QKᵀ and PV
    kv_bytes_per_ctx_token: float  # per layer
    qo_bytes_per_query: float  # per layer
    head_weight_bytes: float
    head_flops_per_token: float
    head_bytes_per_token: float  # fp32 logits written


@cache
def _consts(model: ModelSpec, gpu: GpuSpec) -> _Consts:
    m = model
    q_out = m.heads * m.head_dim
    kv_out = m.kv_heads * m.head_dim
    act = (4 * m.hidden + 2 * q_out + 2 * kv_out + 3 * m.intermediate) * 2
    return _Consts(
        layer_weight_bytes=m.layer_params * m.bytes_per_param,
        act_bytes_per_token=act,
        gemm_flops_per_token=2.0 * m.layer_params,
        attn_flops_per_key=4.0 * q_out,
        kv_bytes_per_ctx_token=2 * kv_out * m.bytes_per_kv,
        qo_bytes_per_query=2 * q_out * 2,
        head_weight_bytes=m.vocab * m.hidden * m.bytes_per_param,
        head_flops_per_token=2.0 * m.vocab * m.hidden,
        head_bytes_per_token=4.0 * m.vocab,
    )


def gemm_efficiency(gpu: GpuSpec, tokens: float) -> float:
    """Fraction of peak a GEMM over ``tokens`` rows reaches: rises smoothly from small to large."""
    lo, hi = gpu.gemm_eff_small, gpu.gemm_eff_large
    return hi - (hi - lo) * math.exp(-tokens / gpu.gemm_eff_tokens)


def _smooth_max(compute_s, memory_s, p: float):
    return (compute_s**p + memory_s**p) ** (1.0 / p)


def _gemm_time_s(gpu: GpuSpec, flops_per_token: float, weight_bytes: float, act_bytes_per_token: float, tokens: int):
    if tokens <= 0:
        return 0.0
    padded = math.ceil(tokens / gpu.tile_tokens) * gpu.tile_tokens
    compute = flops_per_token * padded / (gpu.peak_flops * gemm_efficiency(gpu, padded))
    memory = (weight_bytes + act_bytes_per_token * tokens) / (gpu.hbm_bytes_per_s * gpu.hbm_eff)
    return _smooth_max(compute, memory, gpu.overlap_p)


def forward_time_s(model: ModelSpec, gpu: GpuSpec, seqs: Seqs, *, engine_step: bool = True) -> float:
    """Seconds one forward pass over ``seqs`` takes (no noise).

    ``engine_step``: charge the per-step and per-sequence scheduler overheads too (the target's
    pass of a vLLM step); False for extra passes inside a step (the draft model's).
    """
    q = np.asarray(seqs.query_tokens, dtype=np.float64)
    n_seqs = q.size
    if n_seqs == 0:
        return 0.0
    ctx = np.asarray(seqs.context_tokens, dtype=np.float64)
    c = _consts(model, gpu)
    tokens = int(q.sum())
    gemm = _gemm_time_s(gpu, c.gemm_flops_per_token, c.layer_weight_bytes, c.act_bytes_per_token, tokens)
    # Attention per sequence: query i attends to ctx + i + 1 keys (the causal triangle).
    keys = q * ctx + 0.5 * q * (q + 1.0)
    attn_c = keys * (c.attn_flops_per_key / (gpu.peak_flops * gpu.attn_eff))
    attn_m = ((ctx + q) * c.kv_bytes_per_ctx_token + q * c.qo_bytes_per_query) / (gpu.hbm_bytes_per_s * gpu.hbm_eff)
    attn = float(_smooth_max(attn_c, attn_m, gpu.overlap_p).sum())
    sampled = n_seqs if seqs.sampled_tokens is None else int(np.sum(seqs.sampled_tokens))
    head = _gemm_time_s(gpu, c.head_flops_per_token, c.head_weight_bytes, c.head_bytes_per_token, sampled)
    t = model.layers * (gemm + attn) + head + gpu.launch_overhead_s
    if engine_step:
        t += gpu.step_overhead_s + gpu.per_seq_overhead_s * n_seqs
    return t


def lognormal_noise(rng: np.random.Generator, sigma: float) -> float:
    """A multiplicative noise factor with mean 1 (1.0 when ``sigma`` is 0)."""
    if sigma <= 0:
        return 1.0
    return math.exp(sigma * rng.standard_normal() - 0.5 * sigma * sigma)


def kv_capacity_tokens(
    gpu: GpuSpec,
    target: ModelSpec,
    draft: ModelSpec | None = None,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: float = 4 * GIB,
) -> int:
    """Tokens of KV cache that fit: (memory·util − weights − activation reserve) / KV bytes per token.

    With a draft model both sets of weights are resident and every token holds KV in both.
    """
    weights = target.weight_bytes + (draft.weight_bytes if draft else 0)
    per_token = target.kv_bytes_per_token + (draft.kv_bytes_per_token if draft else 0)
    free = gpu.memory_bytes * gpu_memory_utilization - weights - activation_reserve_bytes
    return max(0, int(free // per_token))
