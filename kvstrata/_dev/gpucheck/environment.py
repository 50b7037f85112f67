"""What machine the GPU check ran on: the facts a figure means nothing without.

GPU, driver and CUDA versions, the PCIe link as the driver reports it (generation and
width, current and maximum: a link trained below its maximum halves every figure),
torch / Triton / cuda-bindings versions, which `cuMemcpyBatchAsync` backend the copy
executor resolved, and whether `cudaHostRegister` of a /dev/shm mapping (what a worker
does with the arena) works and how long it took. Every probe is best effort: a missing
tool or a refusal is reported as such, never raised.

    python -m kvstrata._dev.gpucheck.environment [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import mmap
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

SMI_FIELDS = (
    "driver_version",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
    "clocks.max.sm",
)
PIN_TEST_BYTES = 256 << 20


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_smi() -> dict[str, str]:
    """The driver's view of the GPU and its link; {} where nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"nvidia-smi: {exc}"}
    if out.returncode != 0 or not out.stdout.strip():
        return {"error": f"nvidia-smi exited {out.returncode}: {out.stderr.strip()[:200]}"}
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(SMI_FIELDS, values))


def pin_shared_memory(nbytes: int = PIN_TEST_BYTES) -> dict[str, Any]:
    """cudaHostRegister of a fresh, prefaulted /dev/shm mapping, as a worker pins the arena."""
    from kvstrata.connector.copy.pinning import Pinning

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="kvstrata-gpucheck-pin-", dir=folder)
    pinning = Pinning()
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mapped:
            host = torch.frombuffer(mapped, dtype=torch.int8)
            host.fill_(1)  # prefault, as the arena does
            start = time.perf_counter()
            ok = pinning.register(host)
            seconds = time.perf_counter() - start
            pinning.close()
            del host
        return {"folder": folder, "bytes": nbytes, "registered": ok, "seconds": round(seconds, 4), "failures": pinning.failures}
    finally:
        pinning.close()
        os.close(fd)
        os.unlink(path)


def describe() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "cuda_bindings": _version("cuda-bindings") or _version("cuda-python"),
        "numpy": _version("numpy"),
        "cuda": torch.cuda.is_available(),
    }
    if os.path.isdir("/dev/shm"):
        stat = os.statvfs("/dev/shm")
        info["dev_shm_free_gib"] = round(stat.f_bavail * stat.f_frsize / 2**30, 1)
    if not info["cuda"]:
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(
        gpu=props.name,
        capability=f"{props.major}.{props.minor}",
        sms=props.multi_processor_count,
        gpu_memory_gib=round(props.total_memory / 2**30, 1),
        smi=nvidia_smi(),
    )
    try:
        from kvstrata.connector.copy.cuda_dma import resolve_batch_copy

        info["copy_backend"] = resolve_batch_copy("auto")[1]
    except Exception as exc:  # noqa: BLE001 - reported, the check goes on
        info["copy_backend"] = f"none: {type(exc).__name__}: {exc}"
    try:
        info["pinning"] = pin_shared_memory()
    except Exception as exc:  # noqa: BLE001
        info["pinning"] = {"error": f"{type(exc).__name__}: {exc}"}
    return info


def one_line(info: dict[str, Any]) -> str:
    """The environment as the summary table shows it."""
    if not info.get("cuda"):
        return f"no CUDA; torch {info['torch']}, Python {info['python']}, {info['cpus']} CPUs"
    smi = info.get("smi", {})
    link = (
        f"PCIe gen {smi.get('pcie.link.gen.current')}/{smi.get('pcie.link.gen.max')} "
        f"x{smi.get('pcie.link.width.current')}/{smi.get('pcie.link.width.max')}"
        if "error" not in smi
        else "link unknown"
    )
    pin = info.get("pinning", {})
    pinned = f"pinning {pin.get('seconds')} s/256 MiB" if pin.get("registered") else f"pinning FAILED {pin}"
    return (
        f"{info['gpu']} (sm {info['capability']}, {info['sms']} SMs), driver {smi.get('driver_version', '?')}, "
        f"torch {info['torch']} (CUDA {info['torch_cuda']}), Triton {info['triton']}, {link}; "
        f"copies: {info.get('copy_backend')}; {pinned}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the facts as JSON here")
    args = parser.parse_args(argv)
    info = describe()
    for key, value in info.items():
        print(f"  {key}: {value}")
    print(f"environment: {one_line(info)}", flush=True)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(info, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
