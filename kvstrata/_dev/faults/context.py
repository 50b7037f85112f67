"""Everything one fault row owns (directories, a tmpfs, an S3 server, a proxy), and the
tier configs the rows run under. `RowContext.close` releases all of it, also on failure."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.tiers.disk import HEADER_BYTES

SLOT = 64 * 1024  # the tiny model's KV per 32-token block (2 layers, 4 heads of 32, float32)
ARENA_ALL = 160  # slots: every chunk of a round fits
ARENA_SMALL = 48  # slots: most of a round comes back from the tier under test
# Prompts per batch with ARENA_SMALL: a batch's 30 chunks and an engine's reserve (12, a
# quarter of the arena) fit, so every chunk a batch asks for can be promoted and pinned at
# once; a round's 120 chunks (2.5 arenas) cannot, so each batch comes back from the tier.
BATCH_SMALL = 3
DISK_SLOTS = 320


def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root): the disk-full, read-only and
    shm-full rows need one; elsewhere they are skipped with that reason."""
    return os.geteuid() == 0 and shutil.which("mount") is not None


@dataclass
class RowContext:
    """One row's resources. Injectors keep what they need to lift the fault in `state`."""

    name: str
    workdir: Path
    shm_dir: Path
    disk_dir: Path
    mounts: list[Path] = field(default_factory=list)
    s3: Any = None
    proxy: Any = None
    llm: Any = None
    state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str) -> "RowContext":
        workdir = Path(tempfile.mkdtemp(prefix=f"kvstrata-fault-{name}-"))
        shm_dir = Path(tempfile.mkdtemp(prefix=f"kvstrata-fault-{name}-", dir="/dev/shm"))
        return cls(name, workdir, shm_dir, workdir / "disk")

    def mount_tmpfs(self, path: Path, size_bytes: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path)], check=True)
        self.mounts.append(path)
        return path

    def bind_read_only(self, path: Path) -> None:
        """Make `path` read-only from now on: a read-only bind mount over it. (Remounting the
        tmpfs itself read-only is refused while the store has files open for writing, as
        it always has; descriptors opened before stay writable, as after a chmod.)"""
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        self.mounts.append(path)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)

    def unbind(self, path: Path) -> None:
        """Lift `bind_read_only`: detach the bind (lazily: the store may hold files open on it)."""
        subprocess.run(["umount", "-l", str(path)], check=True)
        self.mounts.remove(path)

    def start_s3(self) -> None:
        from kvstrata._dev.faults.proxy import FaultProxy
        from kvstrata._dev.s3_server import LocalS3Server

        self.s3 = LocalS3Server(self.workdir / "seaweed").start(buckets=("kvstrata",))
        self.proxy = FaultProxy(self.s3.port)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.s3 is not None:
            self.s3.stop()
        for path in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.shm_dir.rmdir()  # only if empty: what is left is reported as a leak first

    # -- tier configs -------------------------------------------------------------------

    def arena(self, slots: int = ARENA_ALL) -> dict[str, Any]:
        # The audit refuses, and counts, any promoted chunk whose bytes no commit had.
        return {"capacity": slots * SLOT, "segment_size": 8 * SLOT, "shm_dir": str(self.shm_dir), "audit_chunks": True}

    def engine(self, **overrides: Any) -> dict[str, Any]:
        # No tolerated view age: background writes finish after the engine last heard from
        # its store, and the next round must see them. Short leases: a dead engine's pins
        # come back within the row.
        # A long control timeout: on two loaded cores a fresh store (and its S3 client) can
        # take longer than the default to answer an engine's registration.
        return {"reserve_slots": 12, "max_view_age_seconds": 0, "lease_seconds": 4, "control_timeout_seconds": 30, **overrides}

    # The rows measure how loads survive faults: with break_even (the default) the tiny
    # model would recompute rather than load from a slowed tier, and no hit would return.
    ADMISSION = {"load": "always"}

    def arena_config(self) -> dict[str, Any]:
        return {"tiers": {"cpu": self.arena()}, "engine": self.engine(), "admission": dict(self.ADMISSION)}

    def disk_config(self) -> dict[str, Any]:
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        disk = {"path": str(self.disk_dir), "capacity": DISK_SLOTS * (SLOT + HEADER_BYTES)}
        tiers = {"cpu": self.arena(ARENA_SMALL), "disk": disk}
        return {"tiers": tiers, "engine": self.engine(), "admission": dict(self.ADMISSION)}

    def disk_capacity(self) -> int:
        return DISK_SLOTS * (SLOT + HEADER_BYTES)

    def object_config(self) -> dict[str, Any]:
        if self.s3 is None:
            self.start_s3()
        tier = {
            "url": "s3://kvstrata/matrix",
            "endpoint_url": self.proxy.endpoint_url,
            "storage_options": self.s3.storage_options(),
            "index_refresh_seconds": 1,
            "timeouts": {"connect_seconds": 1, "read_seconds": 2},
            "max_attempts": 2,
            "backoff_max_seconds": 2,
        }
        tiers = {"cpu": self.arena(ARENA_SMALL), "object": tier}
        return {"tiers": tiers, "engine": self.engine(), "admission": dict(self.ADMISSION)}

    def object_filesystem(self):
        """The bucket, reached directly (not through the proxy): for damage behind the store."""
        return self.s3.filesystem()
