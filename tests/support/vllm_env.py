"""Where scripts/setup-vllm.sh puts the vLLM CPU venv and the tiny model, for the real-vLLM tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CACHE = Path.home() / ".cache" / "sd-controller"
VENV = Path(os.environ.get("SD_VLLM_VENV", CACHE / "vllm-venv"))
MODEL = Path(os.environ.get("SD_TINY_MODEL_DIR", CACHE / "tiny-llama"))
VLLM_PYTHON = VENV / "bin" / "python"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# Real-vLLM tests: marked, and skipped with the reason when the venv or the model is missing.
requires_vllm = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists() or not (MODEL / "config.json").exists(),
        reason=f"needs the vLLM venv ({VLLM_PYTHON}) and the tiny model ({MODEL}): run scripts/setup-vllm.sh",
    ),
]
