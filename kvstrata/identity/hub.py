"""Names a Hugging Face cache snapshot already gives every file by its content.

The hub cache (`<cache>/models--org--name/`) keeps each file once, in `blobs/`, named
by its content: files stored through Git LFS (weights) by their sha256, the others
(configs, tokenizers) by their git blob id (sha1 of `blob <size>\\0<bytes>`). A
snapshot, `snapshots/<commit>/`, is a tree of symbolic links to those blobs. Reading
the link is enough to know the file's content, at zero bytes read.

A name is trusted only when:
- the file is a symbolic link that resolves, inside the cache, to a file directly in
  that repository's `blobs/` whose name is a sha256 or sha1 in hex; and
- the blob has not changed since the link was made: its ctime is not later than the
  link's. `huggingface_hub` writes a blob under a temporary name, renames it into
  `blobs/`, then creates the link; a write through the link afterwards (patching
  `snapshots/<commit>/model.safetensors` in place edits the blob) moves the blob's
  ctime past the link's, and user space cannot move a ctime back.
Any other file of the snapshot (a link elsewhere, a regular file put there by hand, a
blob written after its link) is hashed like a file outside the cache.

No Ray, no vLLM; reads links and inode metadata only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_CONTENT_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


@dataclass(frozen=True)
class HubSnapshot:
    """A snapshot directory of the hub cache, and the real path of its repository's blobs."""

    snapshot: Path
    blobs: str

    def content_name(self, path: Path) -> tuple[str, int] | None:
        """(`sha256:<hex>` or `git:<hex>`, size) for a file of the snapshot named by its
        content, or None when the name cannot be trusted (see the module docstring)."""
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
