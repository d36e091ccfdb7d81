"""Shared test support: a real Prometheus server and a fake vLLM /metrics server."""

# A schema-1 roofline calibration (the example before calibrations were fitted against the
# simulated server): the decision tests were written around its break-even (~14 req/s at vLLM
# acceptance 0.6, γ=4, 512/256 tokens), and loading it exercises the schema migration.
from pathlib import Path as _Path

LEGACY_CALIBRATION = str(_Path(__file__).resolve().parent.parent / "fixtures" / "calibrations" / "roofline-v1.json")
