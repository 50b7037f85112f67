"""This node's memory of file digests, so an engine restart costs a `stat` per file.

An entry maps a file's content key (device, inode, size, mtime_ns, ctime_ns;
`files.content_key`) to the xxh3 digest of its bytes. Any write to a file changes its
mtime and ctime, any replacement its inode, so an entry is found again only for the
very version that was hashed. One small file per entry, named by a digest of the key,
written to a temporary name and renamed into place: engines starting at once on one
node (data-parallel ranks, replicas) never see a half-written entry, and the last
writer of the same entry wins with the same content.

Invariants:
- an entry is written only for a file whose mtime and ctime are at least
  `RACY_SECONDS` old when hashing ended. A write in the same timestamp tick as the
  hash could otherwise leave the key unchanged (git's "racily clean" index entries);
  a file that recent is hashed again at the next start instead;
- an entry that cannot be read, parsed, or whose key or format differs is no entry;
- the cache is an optimisation only: a directory that cannot be created or written
  turns it off (one log line), never an engine start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvstrata.identity.files import PIECE_BYTES, ContentKey

logger = logging.getLogger(__name__)

# Bumped whenever a file's digest is computed differently (the piece size is part of it).
FORMAT = f"xxh3-128-tree-{PIECE_BYTES}"
RACY_SECONDS = 2.0
# More entries than this (each a file of ~150 bytes) and the older half (by when written) goes.
MAX_ENTRIES = 4096
ENV_DIRECTORY = "KVSTRATA_CACHE_DIR"


def default_directory() -> Path:
    """`$KVSTRATA_CACHE_DIR/identity`, else `$XDG_CACHE_HOME/kvstrata/identity`, else
    `~/.cache/kvstrata/identity`: the user's cache, which outlives engines (mount it into
    containers to keep restarts cheap)."""
    if os.environ.get(ENV_DIRECTORY):
        return Path(os.environ[ENV_DIRECTORY]) / "identity"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstrata" / "identity"


class DigestCache:
    """File digests by content key, kept in `directory` (created 0700 on first write)."""

    def __init__(self, directory: Path | None = None, clock: Callable[[], float] = time.time):
        self.directory = directory if directory is not None else default_directory()
        self._clock = clock
        self._writable = True

    def _entry(self, key: ContentKey, kind: str) -> Path:
        name = hashlib.blake2b(f"{kind} {' '.join(map(str, key))}".encode(), digest_size=16).hexdigest()
        return self.directory / name

    def get(self, key: ContentKey, kind: str = FORMAT) -> str | None:
        """The digest (or, for another `kind`, the value) recorded for exactly this
        version of a file, or None."""
        try:
            with open(self._entry(key, kind), encoding="utf-8") as handle:
                entry = json.load(handle)
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("format") != kind or entry.get("key") != list(key):
            return None
        digest = entry.get("digest")
        return digest if isinstance(digest, str) else None

    def put(self, key: ContentKey, digest: str, kind: str = FORMAT) -> bool:
        """Record `digest` for `key` unless the file changed too recently to be trusted
        (see RACY_SECONDS) or the directory is not writable. Returns whether it was kept.
        `kind` names what the value is (a file digest by default; `hub.py` keeps
        verified names)."""
        newest_change = max(key[3], key[4]) / 1e9
        if not self._writable or self._clock() - newest_change < RACY_SECONDS:
            return False
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            payload = json.dumps({"format": kind, "key": list(key), "digest": digest})
            fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".entry-")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(payload)
                os.replace(temporary, self._entry(key, kind))
            except BaseException:
                os.unlink(temporary)
                raise
            self._trim()
        except OSError as exc:
            self._writable = False
            logger.warning(
                "kvstrata: cannot keep model fingerprints in %s (%s): every engine start on this node "
                "hashes its checkpoint again; set %s to a writable directory",
                self.directory, exc, ENV_DIRECTORY,
            )  # fmt: skip
            return False
        return True

    def _trim(self) -> None:
        entries = [entry for entry in os.scandir(self.directory) if not entry.name.startswith(".")]
        if len(entries) <= MAX_ENTRIES:
            return
        entries.sort(key=lambda entry: entry.stat().st_mtime)
        for entry in entries[: len(entries) // 2]:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
