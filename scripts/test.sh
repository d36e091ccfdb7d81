#!/usr/bin/env bash
# The whole test suite on a fresh machine of this kind: installs what the tests need
# (Debian's prometheus for promtool and a real Prometheus server, etcd-server for fleet mode,
# buildah and mmdebstrap for
# the container-image test, the package with its dev extras, and the vLLM CPU build in a
# cached venv), then runs pytest. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# Stock Debian has python3 and no `python`; $PYTHON wins when set.
PY="${PYTHON:-$(command -v python3 || command -v python)}"

need=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# The container-image test builds the image for real: buildah, and mmdebstrap for its base.
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
# Fleet mode's tests run a real etcd (3.4 from Debian).
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
if ((${#need[@]})); then
  echo "== installing ${need[*]} (Debian)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

echo "== installing sd-controller with dev extras"
"$PY" -m pip install -q --disable-pip-version-check -e '.[dev]'

if [ "${SD_SKIP_VLLM:-0}" != "1" ] && [ -f scripts/setup-vllm.sh ]; then
  echo "== preparing the vLLM CPU venv and tiny model (cached between runs)"
  bash scripts/setup-vllm.sh
fi

echo "== running the tests"
exec "$PY" -m pytest "$@"
