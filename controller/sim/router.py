"""The router in front of a simulated fleet: which replica each arrival goes to.

Two policies, as real LLM routers offer them: round-robin (every ready replica in turn) and
least-outstanding-requests (the ready replica with the fewest requests running or waiting,
counting those just sent). A replica that is draining or restarting is out of rotation, as a
failing readiness probe takes it out of a Kubernetes Service; if none is ready, all are
candidates (their queues hold the arrivals until one comes back).
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np


class RouterPolicy(StrEnum):
    ROUND_ROBIN = "rr"
    LEAST_OUTSTANDING = "lor"


class Router:
    """Splits a tick's arrivals over the replicas; remembers its round-robin position."""

    def __init__(self, policy: RouterPolicy | str) -> None:
        try:
            self.policy = RouterPolicy(policy)
        except ValueError:
            raise ValueError(f"router {policy!r}: expected one of {', '.join(p.value for p in RouterPolicy)}") from None
        self._next = 0

    def assign(self, n: int, ready: list[bool], outstanding: list[int]) -> np.ndarray:
        """The replica index of each of ``n`` arrivals, in arrival order."""
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        candidates = [i for i, r in enumerate(ready) if r] or list(range(len(ready)))
        if self.policy is RouterPolicy.ROUND_ROBIN:
            picks = np.asarray(candidates)[(self._next + np.arange(n)) % len(candidates)]
            self._next = (self._next + n) % len(candidates)
            return picks
        load = {i: outstanding[i] for i in candidates}
        out = np.empty(n, dtype=np.int64)
        for k in range(n):
            # Ties go round the candidates, so equal replicas share the load evenly.
            start = self._next % len(candidates)
            order = candidates[start:] + candidates[:start]
            best = min(order, key=load.__getitem__)
            out[k] = best
            load[best] += 1
            self._next = candidates.index(best) + 1
        return out
