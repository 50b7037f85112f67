"""Files in a disk directory the tier cannot use: moved into `<dir>/damaged/`, counted, logged.

Why: whatever a crash, an operator or another program left in the directory, the store
must start and serve the rest (issue #29: a `*-0.payloads` file raised ZeroDivisionError,
a second slab file of one namespace a ValueError, and the whole store died with the
arena). A file the tier cannot use is renamed aside -- never deleted, so an operator can
look at it -- and counted as `damaged_files` in the disk stats.

What counts as unusable: a slab whose namespace is not valid (`kvstrata.namespaces`), a
payload size of 0, a second slab of a namespace already open (another chunk size), a
path that is not a regular file (a directory, a symlink), a file another user owns, and a
slab whose files cannot be opened or read. Records whose headers cannot be read in a
usable slab are no files: they become free records (as before), counted by the index as
`damaged_records` when their header held anything at all.

No Ray, no vLLM; callers hold the tier's lock (start-up).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from kvstrata.namespaces import is_namespace

logger = logging.getLogger("kvstrata.tiers.disk")

DAMAGED_DIR = "damaged"


def unusable_reason(path: Path, namespace: str, payload_bytes: int, open_namespaces: set[str]) -> str | None:
    """Why a slab's payload file cannot be opened as one, or None if it may be tried."""
    if not is_namespace(namespace):
        return f"namespace {namespace!r} is not valid"
    if payload_bytes <= 0:
        return "a chunk size of 0 bytes"
    if namespace in open_namespaces:
        return f"a second slab of namespace {namespace} (another chunk size)"
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        return exc.strerror or str(exc)
    if not stat.S_ISREG(mode):
        return "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
    return None


def set_aside(root: Path, payload_path: Path, header_path: Path, why: str) -> int:
    """Rename a slab's files (those that exist) into `<root>/damaged/`; returns how many
    were moved. A name already there gets a numbered suffix; nothing is ever overwritten."""
    aside = root / DAMAGED_DIR
    moved = 0
    for path in (payload_path, header_path):
        if not os.path.lexists(path):
            continue
        try:
            aside.mkdir(mode=0o700, exist_ok=True)
            target = aside / path.name
            n = 0
            while os.path.lexists(target):
                n += 1
                target = aside / f"{path.name}.{n}"
            os.rename(path, target)  # a symlink moves as itself, never followed
            moved += 1
        except OSError as exc:
            logger.error("kvstrata disk tier: could not set %s aside (%s); it stays, unused", path, exc.strerror or exc)
    logger.debug("kvstrata disk tier: set aside %s: %s", payload_path.name, why)
    return moved


def log_set_aside(root: Path, damaged: list[tuple[str, str]]) -> None:
    """One line for everything set aside at start-up: how many, where, the first and why."""
    if damaged:
        name, why = damaged[0]
        logger.warning(
            "kvstrata disk tier: set aside %d damaged slab(s) in %s (e.g. %s: %s); serving the rest",
            len(damaged), root / DAMAGED_DIR, name, why,
        )  # fmt: skip
