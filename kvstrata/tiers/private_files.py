"""Files the tiers create on a local (or shared, mounted) filesystem: private to the store's
user, never reached through a symlink, and replaced atomically.

Why: a disk directory or a `file://` object root is a place other users or a crashed
store may have touched. A symlink planted there (`<dir>/ns-4096.payloads -> ~/.bashrc`)
would redirect the store's writes; a file of another user would be written with that
user's data mixed in; a reader of a `file://` object written in place could see half of
it. So:

- `open_private` opens with `O_NOFOLLOW` (a symlink at the final component is refused by
  the kernel) and then checks the opened file itself (`fstat`, no race with a rename):
  a regular file owned by this process's effective uid, else `UnsafeFileError` naming the
  path and the owner;
- `write_private_atomically` writes to a fresh temporary name beside the target
  (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600: it cannot be a file someone else made) and
  renames it into place (a reader sees the old object or the whole new one);
- `PrivateLocalFileSystem` is fsspec's local filesystem with its writes and reads done so
  (what the object tier uses for `file://` URLs): parents are created, objects and
  manifests land atomically.

No Ray, no vLLM.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem

logger = logging.getLogger(__name__)

PRIVATE_MODE = 0o600
TEMP_MARK = ".kvstrata-tmp-"  # temporary names end `<name>.kvstrata-tmp-<pid>-<hex>`


class UnsafeFileError(PermissionError):
    """A path the store would write is a symlink, not a regular file, or another user's."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_private(fd: int, path: str | os.PathLike[str]) -> None:
    """Raise `UnsafeFileError` unless the open file `fd` is a regular file of this user."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError(f"{path}: not a regular file; refusing to use it")
    if info.st_uid != os.geteuid():
        raise UnsafeFileError(
            f"{path}: owned by {_owner(info.st_uid)}, not by this store's user {_owner(os.geteuid())}; refusing to use it"
        )


def open_private(path: str | os.PathLike[str], flags: int, mode: int = PRIVATE_MODE) -> int:
    """`os.open` without following a symlink, of a regular file of this user only.

    A symlink is `UnsafeFileError` (the kernel's ELOOP turned into a message naming the path).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symlink
            raise UnsafeFileError(f"{path}: is a symbolic link; refusing to follow it") from None
        raise
    try:
        check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private_atomically(path: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> None:
    """Make `path` hold exactly `data`, mode 0600, created under a fresh name and renamed into
    place; parent directories are created (0700). A symlink at `path` is replaced, never followed."""
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = target.with_name(f"{target.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_MODE)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        os.close(fd)
        fd = -1
        os.replace(temporary, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        temporary.unlink(missing_ok=True)
        raise


def read_private(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a regular file of this user, not through a symlink."""
    fd = open_private(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        parts = []
        while True:
            part = os.read(fd, max(size, 1 << 16))
            if not part:
                return b"".join(parts)
            parts.append(part)
    finally:
        os.close(fd)


class PrivateLocalFileSystem(LocalFileSystem):
    """fsspec's local filesystem whose whole-object writes are private and atomic and whose
    whole-object reads never follow a symlink (the object tier's `file://` URLs)."""

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        write_private_atomically(self._strip_protocol(path), value)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        if start is not None or end is not None:
            return super().cat_file(path, start=start, end=end, **kwargs)
        try:
            return read_private(self._strip_protocol(path))
        except UnsafeFileError as exc:
            # Someone else's object, not a failing store: no bytes (a corrupt chunk, a
            # miss), and the tier is not paused for it.
            logger.warning("kvstrata object tier: %s", exc)
            return b""


def open_private_filesystem(url: str, options: dict[str, Any]) -> tuple[PrivateLocalFileSystem, str]:
    """The filesystem and root of a `file://` (or `local://`) URL, parents created on write."""
    options.setdefault("auto_mkdir", True)
    fs = PrivateLocalFileSystem(skip_instance_cache=True, **options)
    return fs, fs._strip_protocol(url).rstrip("/")
