"""Waiting from variability: what the fluid fixed point leaves out near the stability limit.

The fixed point B = λ·T(B) treats arrivals and request lengths as steady flows. Real arrivals
are Poisson and generated lengths vary, so the batch sometimes fills while the mean is still
below capacity, and requests queue. For a server of ``c`` parallel slots (the batch at which
throughput peaks) each holding a request for ``service_s``, the M/G/c heavy-traffic
approximation of Sakasegawa (1977) with the Allen–Cunneen variability factor gives

    W_q ≈ ρ^(√(2(c+1)) − 1) / (c·(1 − ρ)) · (c_a² + c_s²)/2 · service_s,   ρ = λ / μ,

exact for M/M/1; against Erlang C for M/M/c it errs by −2 % to +4 % of the service time
(tests/test_queueing.py: relatively it overstates small waits at moderate load, which are
negligible next to the service time, and is within 8 % at ρ ≥ 0.8). It diverges as ρ → 1, so
the predicted latency rises toward the limit instead of jumping to "overloaded" at it.
"""

from __future__ import annotations

import math

POISSON_ARRIVAL_SCV = 1.0


def heavy_traffic_wait_s(
    rate_rps: float,
    capacity_rps: float,
    servers: float,
    service_s: float,
    service_scv: float,
    arrival_scv: float = POISSON_ARRIVAL_SCV,
) -> float:
    """Mean wait before admission; +inf at or past capacity, 0 at no load."""
    if rate_rps <= 0.0 or service_s <= 0.0:
        return 0.0
    if capacity_rps <= 0.0 or rate_rps >= capacity_rps:
        return math.inf
    rho = rate_rps / capacity_rps
    c = max(servers, 1.0)
    prob_wait = rho ** (math.sqrt(2.0 * (c + 1.0)) - 1.0)
    return prob_wait / (c * (1.0 - rho)) * 0.5 * (arrival_scv + service_scv) * service_s
