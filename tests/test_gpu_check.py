"""scripts/gpu_check.py must work the first time a GPU machine is lent: its CPU mode runs
here, in a subprocess where every module the GPU image lacks cannot be imported.

The GPU image (../shared/FIELD_NOTES.md, the device tool's package list) has Python 3.12,
torch, Triton, cuda-bindings, numpy, fsspec, xxhash, pyyaml, matplotlib, rich and pytest,
and no vLLM, Ray, pydantic or S3 client; nothing kvstrata builds (the native row copy) is
carried there either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ABSENT_ON_GPU_IMAGE = (
    "vllm", "ray", "pydantic", "pydantic_core", "s3fs", "aiobotocore", "botocore", "boto3",
    "seaweedfs", "kvstrata.connector._rowcopy",
)  # fmt: skip


@pytest.fixture
def blocked_env(tmp_path) -> dict[str, str]:
    """An environment whose Pythons (and their children) refuse the modules above."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import importlib.abc, sys
            BLOCKED = {ABSENT_ON_GPU_IMAGE!r}

            class _NotOnTheGpuImage(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                        raise ImportError(f"{{name}} is not on the GPU image (blocked by tests/test_gpu_check.py)")
                    return None

            sys.meta_path.insert(0, _NotOnTheGpuImage())
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_the_blocker_blocks(blocked_env):
    probe = "import importlib\nfor m in ('ray', 'vllm', 'pydantic'):\n    try:\n        importlib.import_module(m)\n    except ImportError:\n        print('blocked', m)"
    out = subprocess.run([sys.executable, "-c", probe], env=blocked_env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:3] == ["blocked ray", "blocked vllm", "blocked pydantic"], out.stderr


def test_the_gpu_check_runs_in_cpu_mode_with_only_what_the_gpu_image_has(tmp_path, blocked_env):
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", str(out_dir), "--cpu"],
        cwd=ROOT,
        env=blocked_env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "not on the GPU image" not in proc.stdout
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    # What the device tool brings back: at most 8 files, at most two folders down.
    assert len(files) <= 8, files
    assert all(len(p.relative_to(out_dir).parts) <= 3 for p in files)
    assert {p.name for p in files} == {
        "check.log", "summary.md", "env.json", "harness.json", "gpu_copy.csv", "gpu_copy.md", "gpu_copy.png", "gpu_copy.json",
    }  # fmt: skip
    summary = (out_dir / "summary.md").read_text()
    for part in ("environment", "pytest -m gpu", "harness", "benchmark"):
        assert f"| {part} | ok |" in summary, summary
    assert "skipped" in summary  # pytest ran and skipped the CUDA tests
    harness = json.loads((out_dir / "harness.json").read_text())
    from kvstrata._dev.gpucheck.layouts import LAYOUTS

    assert harness["runs"] == len(LAYOUTS) and harness["failed_runs"] == 0 and harness["chunks_checked"] > 0
    assert "gpu check: 4/4 parts ok" in proc.stdout


def test_a_part_that_fails_or_hangs_is_reported_and_the_next_still_runs(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    steps = [
        gpu_check.Part("hang", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 1),
        gpu_check.Part("fail", [sys.executable, "-c", "raise SystemExit(3)"], 10),
        gpu_check.Part("fine", [sys.executable, "-c", "print('done')"], 10),
    ]
    with open(tmp_path / "log", "w") as log:
        for part in steps:
            gpu_check.run_part(part, log, scale=1.0)
    assert [p.status for p in steps] == ["timed out (1 s)", "failed (exit 3)", "ok"]
    assert steps[0].seconds < 20 and steps[0].output == ["started"]
    assert "==== fine: ok" in (tmp_path / "log").read_text()
