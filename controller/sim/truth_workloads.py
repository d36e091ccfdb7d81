"""Named workload mixes for load tests against the simulated server (the ground truth).

Each class draws per-request prompt and generation lengths with real spread (lognormal
prompts, gamma-distributed generations); its name is the request's ``kind``, which selects
the draft acceptance α in :class:`controller.sim.stepsim.ServerSpec`. A class may put a shared
prefix (a system prompt) in front of every prompt: each request then belongs to one of
``prefix_groups`` groups, drawn uniformly, whose requests share their first ``prefix_tokens``
tokens, which vLLM's prefix cache serves once computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from controller.benchmark.probe import ProbeRequest


@dataclass(frozen=True)
class WorkloadClass:
    """Length distributions of one kind of request (means in tokens).

    With ``prefix_groups`` > 0, a prompt is ``prefix_tokens`` shared tokens plus a body drawn as
    without them: ``prompt_mean_tokens``, ``prompt_sigma`` and ``max_prompt_tokens`` then describe
    the body (the prompt's mean is ``prefix_tokens + prompt_mean_tokens``).
    """

    kind: str
    prompt_mean_tokens: float
    prompt_sigma: float  # of log(prompt)
    gen_mean_tokens: float
    gen_shape: float  # gamma shape: 1 = exponential, larger = tighter
    max_prompt_tokens: int = 16384
    max_gen_tokens: int = 4096
    prefix_tokens: int = 0  # shared by the requests of a group (only with prefix_groups > 0)
    prefix_groups: int = 0  # 0: no shared prefix

    def __post_init__(self) -> None:
        if self.prefix_groups < 0 or self.prefix_tokens < 0 or (self.prefix_groups > 0) != (self.prefix_tokens > 0):
            raise ValueError(f"{self.kind}: prefix_tokens and prefix_groups must both be > 0, or both 0")

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_tokens, gen_tokens), integers ≥ 1; prompts include the shared prefix."""
        mu = np.log(self.prompt_mean_tokens) - 0.5 * self.prompt_sigma**2  # so the mean is the mean
        prompt = np.rint(rng.lognormal(mu, self.prompt_sigma, n))
        gen = np.rint(rng.gamma(self.gen_shape, self.gen_mean_tokens / self.gen_shape, n))
        return (
            self.prefix_tokens + np.clip(prompt, 1, self.max_prompt_tokens).astype(np.int64),
            np.clip(gen, 1, self.max_gen_tokens).astype(np.int64),
        )

    def draw_groups(self, rng: np.random.Generator, n: int) -> list[str]:
        """Each request's prefix group, uniform over the class's groups ("" and no draw without)."""
        if not self.prefix_groups:
            return [""] * n
        return [f"{self.kind}:{k}" for k in rng.integers(self.prefix_groups, size=n).tolist()]


@dataclass(frozen=True)
class Mix:
    """Workload classes with their shares of the requests."""

    name: str
    classes: tuple[tuple[WorkloadClass, float], ...]


CHAT = WorkloadClass("chat", prompt_mean_tokens=900, prompt_sigma=0.6, gen_mean_tokens=280, gen_shape=2.0)
CODE = WorkloadClass("code", prompt_mean_tokens=1000, prompt_sigma=0.5, gen_mean_tokens=300, gen_shape=2.5)
LONG_PROMPT = WorkloadClass(
    "long_prompt", prompt_mean_tokens=4000, prompt_sigma=0.4, gen_mean_tokens=200, gen_shape=2.0
)
# Mixes no part of the model was developed on (stop 30): prompts with a heavy tail (σ = 1.2:
# a few take 10k+ tokens of KV) and generations more spread than exponential, which fill the KV
# cache before max_num_seqs; and short prompts with long, exponential generations.
LONG_TAIL = WorkloadClass("long_tail", prompt_mean_tokens=1500, prompt_sigma=1.2, gen_mean_tokens=500, gen_shape=0.7)
REASONING = WorkloadClass("reasoning", prompt_mean_tokens=300, prompt_sigma=0.8, gen_mean_tokens=1200, gen_shape=1.0)
# Retrieval-augmented requests (6k-token prompts, short answers) among chat: bimodal prompts.
RAG = WorkloadClass("rag", prompt_mean_tokens=6000, prompt_sigma=0.3, gen_mean_tokens=150, gen_shape=2.0)
# Shared prefixes for the prefix cache (kinds chat and code: their acceptance classes apply).
# Chat behind one of 4 system prompts of 1536 tokens; an agent's 3072-token tool preamble, 2 of them.
SYSTEM_PROMPT = WorkloadClass(
    "chat", prompt_mean_tokens=600, prompt_sigma=0.6, gen_mean_tokens=280, gen_shape=2.0,
    prefix_tokens=1536, prefix_groups=4,
)  # fmt: skip
AGENT = WorkloadClass(
    "code", prompt_mean_tokens=1200, prompt_sigma=0.5, gen_mean_tokens=250, gen_shape=2.5,
    prefix_tokens=3072, prefix_groups=2,
)  # fmt: skip

MIXES: dict[str, Mix] = {
    "chat": Mix("chat", ((CHAT, 1.0),)),
    "code": Mix("code", ((CODE, 1.0),)),
    "mixed": Mix("mixed", ((CHAT, 0.5), (CODE, 0.5))),
    "long_prompt": Mix("long_prompt", ((LONG_PROMPT, 1.0),)),
    "long_tail": Mix("long_tail", ((LONG_TAIL, 1.0),)),
    "reasoning": Mix("reasoning", ((REASONING, 1.0),)),
    "rag_mix": Mix("rag_mix", ((RAG, 0.3), (CHAT, 0.7))),
    "system_prompt": Mix("system_prompt", ((SYSTEM_PROMPT, 1.0),)),
    "agent": Mix("agent", ((AGENT, 1.0),)),
}


def poisson_load(rate_rps: float, duration_s: float, mix: Mix | str, rng: np.random.Generator) -> list[ProbeRequest]:
    """Constant-rate Poisson arrivals over ``duration_s``, each with its class's lengths, kind and prefix group."""
    if isinstance(mix, str):
        mix = MIXES[mix]
    n = int(rng.poisson(rate_rps * duration_s)) if rate_rps > 0 and duration_s > 0 else 0
    send_s = np.sort(rng.uniform(0.0, duration_s, n))
    weights = np.array([w for _, w in mix.classes], dtype=float)
    which = rng.choice(len(mix.classes), size=n, p=weights / weights.sum())
    prompt = np.empty(n, dtype=np.int64)
    gen = np.empty(n, dtype=np.int64)
    groups = [""] * n
    for i, (cls, _) in enumerate(mix.classes):
        idx = np.flatnonzero(which == i)
        prompt[idx], gen[idx] = cls.draw(rng, idx.size)
        for j, group in zip(idx.tolist(), cls.draw_groups(rng, idx.size), strict=True):
            groups[j] = group
    classes = [mix.classes[i][0] for i in which.tolist()]
    return [
        ProbeRequest(
            send_at_s=float(s),
            prompt_tokens=int(p),
            max_tokens=int(m),
            kind=c.kind,
            prefix_group=grp,
            prefix_tokens=c.prefix_tokens if grp else 0,
        )
        for s, p, m, c, grp in zip(send_s.tolist(), prompt.tolist(), gen.tolist(), classes, groups, strict=True)
    ]
