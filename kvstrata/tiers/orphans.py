"""Files of stores that died without cleaning up: found by their free lock, and unlinked.

Why: a store killed with its Ray cluster (`ray stop`, the head's driver exiting, a raylet
crash) never runs its `close`, and tmpfs keeps its arena segments, RAM that nothing frees
until a reboot (measured: 2.8 GB in /dev/shm after a handful of such runs).

The rule: every live store holds an exclusive `flock` on each segment it created, on a
descriptor it keeps open for the segment's life (`hold_new_file`). The kernel drops that
lock when the process dies, however it dies. So a `kvstrata-*` file in `shm_dir` whose
lock can be taken belongs to no live store, and may go; one whose lock is held is never
touched. This holds across simulated nodes sharing /dev/shm and across Ray clusters on
one machine, because the lock is the kernel's, not anyone's bookkeeping.

Invariants:
- A creator takes the lock before anyone can see the file as free for long: it creates
  the file (`O_EXCL`), locks it, then checks the name still points at the inode it
  locked. A reclaimer that slipped in between (the file was briefly unlocked) has
  unlinked it; the creator then starts again under the same name.
- A reclaimer unlinks a file only while it holds that file's lock, and only if the name
  still points at the inode it locked.
- Only regular files of this user are looked at; symlinks are never followed.
- Unlinking frees the memory once no process maps the file any more (an engine's worker
  that still maps a dead store's segment keeps those pages until it unmaps them).

No Ray and no vLLM in here.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

SEGMENT_GLOB = "kvstrata-*"  # every arena segment: kvstrata-<node tag>-<epoch>-<namespace>-<n>
CREATE_ATTEMPTS = 3


@dataclass
class Reclaimed:
    """What one reclaim pass unlinked: the files and the bytes of memory or disk they held."""

    files: list[str] = field(default_factory=list)
    bytes: int = 0

    def add(self, other: "Reclaimed") -> None:
        self.files += other.files
        self.bytes += other.bytes


def hold_new_file(path: str | os.PathLike[str], mode: int = 0o600) -> int:
    """Create `path` (it must not exist) and return a descriptor holding its exclusive lock.

    The lock lives as long as the descriptor: close it only after unlinking the file (or
    let the process die). Raises FileExistsError as `os.open(O_EXCL)` does, also for a
    symlink planted at `path` (dangling or not): it is never followed.
    """
    for _ in range(CREATE_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            # Blocking: a reclaimer holds it only for the instant it takes to unlink.
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(path, os.fstat(fd)):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # a reclaimer unlinked it before the lock was ours: create it again
    raise OSError(f"{path}: unlinked by other processes {CREATE_ATTEMPTS} times while being created")


def is_locked(path: str | os.PathLike[str]) -> bool | None:
    """Whether a live process holds `path`'s lock; None if it is not a file of ours to judge."""
    fd = _open_candidate(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also lets go of the lock, if it was taken here
    return False


def reclaim(paths: Iterable[str | os.PathLike[str]]) -> Reclaimed:
    """Unlink those of `paths` whose lock is free; files held by a live store stay."""
    found = Reclaimed()
    for path in paths:
        freed = _reclaim_one(path)
        if freed is not None:
            found.files.append(str(path))
            found.bytes += freed
    return found


def orphan_candidates(directory: str | os.PathLike[str], pattern: str = SEGMENT_GLOB) -> list[str]:
    """Files in `directory` matching `pattern` whose lock is free right now (nothing unlinked)."""
    return [path for path in sorted(glob.glob(os.path.join(glob.escape(str(directory)), pattern))) if is_locked(path) is False]


def reclaim_orphans(directory: str | os.PathLike[str], pattern: str = SEGMENT_GLOB, why: str = "") -> Reclaimed:
    """Unlink every file in `directory` matching `pattern` that no live store holds; one log line if any."""
    found = reclaim(sorted(glob.glob(os.path.join(glob.escape(str(directory)), pattern))))
    log_reclaimed(found, directory, why)
    return found


def log_reclaimed(found: Reclaimed, directory: str | os.PathLike[str], why: str = "") -> None:
    """One line per reclaim pass that found something: how many files, how many bytes, which."""
    if not found.files:
        return
    names = ", ".join(os.path.basename(path) for path in found.files[:4])
    more = f" and {len(found.files) - 4} more" if len(found.files) > 4 else ""
    logger.warning(
        "kvstrata: reclaimed %d file(s) in %s left by stores that died without cleaning up%s: %d bytes freed (%s%s)",
        len(found.files), directory, f" ({why})" if why else "", found.bytes, names, more,
    )  # fmt: skip


def _open_candidate(path: str | os.PathLike[str]) -> int | None:
    """A read-only descriptor of `path` if it is a regular file of this user, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone, a symlink, or not ours to read
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def _reclaim_one(path: str | os.PathLike[str]) -> int | None:
    """Unlink `path` if its lock is free: the bytes it held, or None if it stays."""
    fd = _open_candidate(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None  # a live store holds it
    try:
        info = os.fstat(fd)
        if not _same_file(path, info):
            return None  # replaced since it was opened: judged on its next pass
        os.unlink(path)
        return info.st_blocks * 512  # what it held (a sparse file holds less than its size)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)


def _same_file(path: str | os.PathLike[str], info: os.stat_result) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)
