"""Names a Hugging Face cache snapshot gives every file by its content, verified once per node.

The hub cache (`<cache>/models--org--name/`) keeps each file once, in `blobs/`, named
by its content: files stored through Git LFS (weights) by their sha256, the others
(configs, tokenizers) by their git blob id (sha1 of `blob <size>\\0<bytes>`). A
snapshot, `snapshots/<commit>/`, is a tree of symbolic links to those blobs.

A name is only a claim: a write through the link (patching
`snapshots/<commit>/model.safetensors` in place) edits the blob and leaves its name.
Until 27 Nov 2026 a name was trusted when the blob's ctime was not later than its
link's; copying the cache (`cp -a`, rsync, an image layer: links newer than blobs),
`chown -R` or `touch -h` erase that evidence and gave an edited checkpoint the
original's identity (issue 51, finding 2). So a name is trusted only for the very
version of the blob whose bytes were read and found to be what the name says: the
blob's content key (device, inode, size, mtime_ns, ctime_ns; `files.content_key`) is
remembered beside the verified name in the node's `DigestCache`, as plain files'
digests are. A node's first start reads each blob once (sha256 or git's sha1); a
restart costs a `stat`. A file whose bytes are not what its name says is hashed like
a file outside the cache.

A candidate name (`content_name`) is offered only when the file is a symbolic link
that resolves, inside the cache, to a file directly in that repository's `blobs/`
whose name is a sha256 or sha1 in hex, and the blob was not written after its link
(then it was certainly edited: hashed at once, not verified).

No Ray, no vLLM.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvstrata.identity.files import MAX_THREADS, READ_BYTES, ContentKey, FileChanged, content_key

_CONTENT_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
# The DigestCache format of a verified name: the entry holds the name, keyed by the
# content key of the blob version whose bytes were found to be what the name says.
VERIFIED_NAME_FORMAT = "hub-name-verified-1"


@dataclass(frozen=True)
class HubSnapshot:
    """A snapshot directory of the hub cache, and the real path of its repository's blobs."""

    snapshot: Path
    blobs: str

    def content_name(self, path: Path) -> tuple[str, int] | None:
        """(`sha256:<hex>` or `git:<hex>`, size): what the snapshot claims the file holds,
        or None when it makes no such claim or the blob was written after its link (see
        the module docstring). A claim is trusted only once verified (`verify_names`)."""
        try:
            if not path.is_symlink():
                return None
            target = os.path.realpath(path)
            name = os.path.basename(target)
            if os.path.dirname(target) != self.blobs or not _CONTENT_NAME.fullmatch(name):
                return None
            link, blob = os.lstat(path), os.stat(target)
        except OSError:
            return None
        if blob.st_ctime_ns > link.st_ctime_ns:
            return None  # the blob was written after its link: a local edit, not the hub's file
        return f"{'sha256' if len(name) == 64 else 'git'}:{name}", blob.st_size


def hub_snapshot(root: Path) -> HubSnapshot | None:
    """The hub snapshot `root` lies in (root is the snapshot, a folder or a file in it),
    or None when `root` is not inside `<repo>/snapshots/<commit>/` next to `<repo>/blobs/`."""
    root = Path(os.path.abspath(root))
    for candidate in (root, *root.parents):
        if candidate.parent.name == "snapshots":
            blobs = candidate.parent.parent / "blobs"
            if candidate.parent.parent.name.count("--") >= 1 and blobs.is_dir():
                return HubSnapshot(candidate, os.path.realpath(blobs))
            return None
    return None


def _matches(path: Path, tag: str) -> tuple[bool, ContentKey, int]:
    """Read every byte of `path` and say whether they are what `tag` names; with the
    content key of the version read. Raises FileChanged if the file changed meanwhile."""
    kind, name = tag.split(":", 1)
    fd = os.open(path, os.O_RDONLY)
    try:
        before = os.fstat(fd)
        digest = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % before.st_size)
        buffer = memoryview(bytearray(READ_BYTES))
        offset = 0
        while count := os.preadv(fd, [buffer], offset):
            digest.update(buffer[:count])  # hashlib releases the GIL: files verify in parallel
            offset += count
        after, now = os.fstat(fd), os.stat(path)
    finally:
        os.close(fd)
    if not content_key(before) == content_key(after) == content_key(now) or offset != before.st_size:
        raise FileChanged(f"{path} changed while its hub name was verified")
    return digest.hexdigest() == name, content_key(before), offset


def verify_names(claims: Iterable[tuple[Path, str]]) -> dict[Path, tuple[bool, ContentKey, int]]:
    """For each (path, tag), whether the file's bytes are what the tag names, the content
    key of the version read, and the bytes read; several files at once."""
    claims = list(claims)
    if not claims:
        return {}
    with ThreadPoolExecutor(min(MAX_THREADS, len(claims)), thread_name_prefix="kvstrata-identity") as pool:
        return dict(zip((path for path, _ in claims), pool.map(lambda claim: _matches(*claim), claims)))
