"""Where `kvstrata bench` writes, so it never touches the live node store's files.

Every location is a subdirectory named `.kvstrata-bench-<pid>` beside the live tier's own
files, so the figures come from the same memory, disk and bucket:
- shared memory: `<tiers.cpu.shm_dir>/.kvstrata-bench-<pid>/` holds the scratch arenas and
  the references' memory (a live store only looks at `kvstrata-<node>-*` files at the top of
  `shm_dir`);
- disk: `<tiers.disk.path>/.kvstrata-bench-<pid>/` (a live disk tier only opens the slab
  files at the top of its directory);
- object store: `<tiers.object.url>/.kvstrata-bench-<pid>/` (a live store's sweep skips
  dot-named prefixes under its URL: they are not namespaces).

Invariants: `Scratch` removes every location it handed out when its `ExitStack` unwinds, on
success, error or KeyboardInterrupt alike, and a directory it had to create for them (a
configured disk path that did not exist yet) when it is left empty. Local leftovers of a
bench that was killed (its pid gone) are removed when the next one starts.
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

from kvstrata.config import KvstrataConfig, ObjectTierConfig
from kvstrata.tiers.object_store import open_filesystem

logger = logging.getLogger(__name__)

SCRATCH_PREFIX = ".kvstrata-bench-"


def scratch_name(pid: int | None = None) -> str:
    return f"{SCRATCH_PREFIX}{os.getpid() if pid is None else pid}"


def bench_node_id(pid: int | None = None) -> str:
    """The scratch stores' node id: it names their arena files, and an arena removes files
    of its own node tag (12 characters) left by an earlier store, so it must differ from
    every live store's (Ray node ids are hex) and every other bench's (its pid)."""
    return f"bench{os.getpid() if pid is None else pid}"[:12]


class Scratch:
    """The scratch locations of one bench run, each created on first use and removed at exit."""

    def __init__(self, config: KvstrataConfig, stack: ExitStack):
        self.config = config
        self._stack = stack
        self._shm_dir: str | None = None
        self._disk_dir: str | None = None

    @property
    def shm_dir(self) -> str:
        if self._shm_dir is None:
            self._shm_dir = self._local_dir(self.config.tiers.cpu.shm_dir)
        return self._shm_dir

    @property
    def disk_dir(self) -> str:
        if self._disk_dir is None:
            self._disk_dir = self._local_dir(self.config.tiers.disk.path)
        return self._disk_dir

    def object_tier(self) -> ObjectTierConfig:
        """The object tier's settings with its URL moved to the scratch prefix, removed at exit.

        Sweeps of the scratch store never delete (no capacity, no TTL) and run once per
        namespace, not during a measurement.
        """
        live = self.config.tiers.object
        scratch = live.model_copy(
            update={
                "url": f"{live.url.rstrip('/')}/{scratch_name()}",
                "capacity": None,
                "ttl_seconds": None,
                "index_refresh_seconds": 3600.0,
                "write_policy": "write_through",
            }
        )
        fs, root = open_filesystem(live)
        # A local root (file://) may get its directories made by the bench's first write.
        made = [p for p in (Path(root), *Path(root).parents) if not p.exists()] if _is_local(fs) else []
        self._stack.callback(_remove_empty, made)
        self._stack.callback(remove_objects, scratch)  # runs first
        return scratch

    def _local_dir(self, parent: str) -> str:
        parent_path = Path(parent)
        made = [p for p in (parent_path, *parent_path.parents) if not p.exists()]
        remove_dead_scratch(parent_path)
        path = parent_path / scratch_name()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._stack.callback(_remove_dir, path, made)
        return str(path)


def remove_objects(config: ObjectTierConfig) -> None:
    """Delete everything under a scratch URL; a failure is logged (it names the prefix to remove by hand)."""
    try:
        fs, root = open_filesystem(config)
        if fs.exists(root):
            fs.rm(root, recursive=True)
    except Exception as exc:  # noqa: BLE001 - cleanup must not hide the error that got us here
        logger.warning("kvstrata bench: could not remove %s (%s); remove it by hand", config.url, exc)


def remove_dead_scratch(parent: Path) -> list[Path]:
    """Remove `.kvstrata-bench-<pid>` directories in `parent` whose process is gone."""
    removed = []
    if not parent.is_dir():
        return removed
    for path in parent.glob(f"{SCRATCH_PREFIX}*"):
        pid = path.name[len(SCRATCH_PREFIX) :]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("kvstrata bench: removed %d scratch directories of benches that were killed", len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _remove_dir(path: Path, made: list[Path]) -> None:
    shutil.rmtree(path, ignore_errors=True)
    _remove_empty(made)


def _remove_empty(made: list[Path]) -> None:
    for directory in made:  # innermost first: only those this bench created, only if empty
        try:
            directory.rmdir()
        except OSError:
            break


def _is_local(fs: object) -> bool:
    protocol = getattr(fs, "protocol", "")
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))
