"""An engine process that joined Ray through kvstrata still stops on SIGTERM its own way.

vLLM's client stops its engine core with SIGTERM, and the core's handler shuts it down
cleanly. `ray.init` in that process (kvstrata's scheduler side joins the cluster there)
replaced the handler with Ray's and added Abseil's, which printed a stack dump at every
engine shutdown. A stand-in engine core here: a process with its own SIGTERM handler that
joins the test's cluster, then is sent SIGTERM.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from tests.utils import local_ray

# Installs a handler like vLLM's engine core, joins the cluster, says so, then waits to be stopped.
ENGINE_CORE = """
import signal, sys, time
def stop(signum, frame):
    print("own handler ran", flush=True)
    raise SystemExit(0)
signal.signal(signal.SIGTERM, stop)
if sys.argv[1] == "keeping-signals":
    from kvstrata.connector.ray_join import join_cluster_keeping_signals as join
else:
    from kvstrata.actors.client import join_cluster as join
join("auto")
print("joined", flush=True)
time.sleep(120)
"""
JOIN_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster():
    with local_ray("kvstrata-test-engine-signals"):
        yield


def stop_with_sigterm(how: str) -> tuple[int, str, str]:
    """Run the stand-in engine core joining with `how`, SIGTERM it once joined; (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    core = subprocess.Popen(
        [sys.executable, "-c", ENGINE_CORE, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        ready, _, _ = select.select([core.stdout], [], [], JOIN_TIMEOUT_S)
        joined = core.stdout.readline() if ready else ""
        assert joined == "joined\n", f"the process did not join within {JOIN_TIMEOUT_S}s: {core.stderr.read() if core.poll() is not None else ''}"
        core.send_signal(signal.SIGTERM)
        stdout, stderr = core.communicate(timeout=JOIN_TIMEOUT_S)
        return core.returncode, stdout, stderr
    finally:
        if core.poll() is None:
            core.kill()
            core.wait(timeout=JOIN_TIMEOUT_S)


def test_an_engine_core_that_joined_ray_stops_through_its_own_handler_without_a_stack_dump(cluster):
    code, stdout, stderr = stop_with_sigterm("keeping-signals")
    assert (code, stdout) == (0, "own handler ran\n")
    assert "SIGTERM received" not in stderr


def test_a_plain_ray_join_takes_sigterm_over(cluster):
    """The control: without the guard, Ray's handler exits with 15 and Abseil dumps a stack.
    If this fails, Ray no longer does this and the guard may be dropped."""
    code, stdout, stderr = stop_with_sigterm("plain")
    assert (code, stdout) == (15, "")
    assert "SIGTERM received" in stderr
