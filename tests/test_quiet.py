"""`kvstrata.quiet`: an example's own lines reach the terminal; what it, its libraries and
the processes it starts write to stdout or stderr goes to the log file it names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# An example in miniature: its own line, a kvstrata warning, and chatter from Python, from
# C-level writes and from a child process, then (with "fail") an exception.
EXAMPLE = r"""
import logging, os, subprocess, sys, warnings
from kvstrata.quiet import quiet_output
with quiet_output("mini") as terminal:
    print("result: 42", file=terminal)
    logging.getLogger("kvstrata._dev.testing").warning("an engine process did not exit")
    print("chatter on stdout")
    print("chatter on stderr", file=sys.stderr)
    warnings.warn("a library's warning")
    os.write(2, b"chatter from C\n")
    subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"], check=True)
    if sys.argv[1] == "fail":
        raise RuntimeError("the engine did not start")
print("after the example", flush=True)
"""
CHATTER = ["chatter on stdout", "chatter on stderr", "a library's warning", "chatter from C", "child out", "child err"]


def run_example(tmp_path: Path, outcome: str) -> tuple[subprocess.CompletedProcess, Path]:
    env = dict(os.environ, KVSTRATA_EXAMPLE_LOG_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    run = subprocess.run(
        [sys.executable, "-c", EXAMPLE, outcome], capture_output=True, text=True, env=env, timeout=60
    )
    return run, tmp_path / "mini.log"


def test_the_terminal_gets_the_examples_lines_and_the_log_gets_the_rest(tmp_path):
    run, log = run_example(tmp_path, "succeed")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        f"vLLM, Ray and torch messages: {log}",
        "result: 42",
        "WARNING kvstrata._dev.testing: an engine process did not exit",
        "after the example",
    ]
    assert run.stderr == ""
    logged = log.read_text()
    assert all(line in logged for line in CHATTER), logged
    assert "result: 42" not in logged


def test_a_failing_example_shows_the_end_of_its_log_and_its_traceback(tmp_path):
    run, log = run_example(tmp_path, "fail")
    assert run.returncode == 1
    shown = run.stdout.split(f" lines of {log}:\n", 1)[1]
    assert all(f"   {line}" in shown for line in ["chatter on stdout", "chatter from C", "child err"]), run.stdout
    assert "RuntimeError: the engine did not start" in run.stderr.splitlines()[-1]
    assert "after the example" not in run.stdout
