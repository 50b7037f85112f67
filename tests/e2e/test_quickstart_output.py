"""The quickstart's output fits on one screen: its results, with vLLM's, Ray's and torch's
messages in the log file it names on its first line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCREEN_LINES = 40
RUN_TIMEOUT_S = 600


def test_the_quickstart_prints_its_results_on_one_screen_and_logs_the_rest(tmp_path):
    env = dict(
        os.environ,
        KVSTRATA_EXAMPLE_LOG_DIR=str(tmp_path),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    env.pop("RAY_ADDRESS", None)  # the quickstart starts its own cluster
    run = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        timeout=RUN_TIMEOUT_S,
    )
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout
    assert len(lines) <= SCREEN_LINES, run.stdout
    assert "Traceback" not in run.stdout
    log = tmp_path / "quickstart.log"
    assert lines[0] == f"vLLM, Ray and torch messages: {log}"
    assert lines[-1] == "outputs identical across rounds: True; rounds 2 and 3 served from kvstrata: True"
    # The chatter went to the log, not nowhere: vLLM's engine processes wrote there too.
    logged = log.read_text()
    assert "EngineCore" in logged and "Worker" in logged
    assert "SIGTERM received" not in logged  # no stack dumps at engine shutdown (connector/ray_join.py)
