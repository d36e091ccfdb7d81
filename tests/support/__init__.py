"""Shared test support: a real Prometheus server and a fake vLLM /metrics server."""

# A schema-1 roofline calibration (the example before calibrations were fitted against the
# simulated server): the decision tests were written around its break-even (~14 req/s at vLLM
# acceptance 0.6, γ=4, 512/256 tokens), and loading it exercises the schema migration.
from pathlib import Path as _Path

LEGACY_CALIBRATION = str(_Path(__file__).resolve().parent.parent / "fixtures" / "calibrations" / "roofline-v1.json")


def zero_cost_calibration() -> dict:
    """The shipped example with every pass cost zero: valid field by field, pricing nothing."""
    import json

    from controller.shipped import example_calibration_path

    cal = json.loads(example_calibration_path().read_text())
    for phase in cal["phases"].values():
        if isinstance(phase, dict):  # the pass costs (not the flags and the SD overhead)
            phase.update(
                intercept_s=0.0,
                slope_s_per_token=0.0,
                context_s_per_token=0.0,
                seq_s=0.0,
                attention_s_per_pair=0.0,
                knees=[],
            )
    cal["phases"]["sd_overhead_s"] = 0.0
    return cal
