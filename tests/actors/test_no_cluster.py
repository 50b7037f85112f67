"""Without a Ray cluster, joining fails fast with a message that says how to start one."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import os
os.environ.pop("RAY_ADDRESS", None)
from ray._private.services import find_gcs_addresses
if find_gcs_addresses():
    print("SKIP: a Ray cluster is running on this machine")
    raise SystemExit(0)
from kvstrata.actors.client import StoreUnavailable, join_cluster
try:
    join_cluster("auto")
except StoreUnavailable as exc:
    print("ERROR:", exc)
else:
    print("JOINED")
"""


def test_missing_ray_cluster_is_a_clear_error():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.stdout.startswith("ERROR:"), out.stdout + out.stderr
    assert "ray start --head" in out.stdout
    assert "examples/quickstart.py" in out.stdout
