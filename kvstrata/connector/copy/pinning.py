"""Registers node-arena segments with CUDA (cudaHostRegister) so copies can use them.

Why: DMA from pageable memory is staged through a driver bounce buffer (slower, and
never asynchronous), and the Triton copy kernel can only read host memory that is
registered. Registration is per process, so each worker registers the segments it
maps, once.

Invariants:
  * a range is registered in pieces of at most `piece_bytes` (64 GiB): very large
    single registrations fail on some drivers;
  * a range is all registered or not at all: when a piece fails, the pieces before it
    are unregistered again (rollback);
  * a failed registration never raises out of `Pinning.register`: the copy still works
    from pageable memory, so the failure is logged once per worker and counted in
    `Pinning.failures`; `register_range` (the primitive) does raise `HostRegisterError`;
  * a failed cudaHostRegister leaves its error as the runtime's "last error", which torch
    would report at its next kernel launch; the error is cleared right away;
  * a page-aligned range is registered up to its next page boundary: CUDA refuses a
    length that is not a whole number of host pages (cudaErrorInvalidValue, seen on an
    H200 with driver 580 for a 30,720-byte arena segment), and a mapping always covers
    whole pages, so the rounded range stays inside it.

Torch only (the cudart functions come from torch.cuda.cudart()); every CUDA function is
injectable so the piece split and the rollback are tested on a CPU machine.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GIB = 1 << 30
PIECE_BYTES = 64 * GIB
HOST_REGISTER_DEFAULT = 0
HOST_REGISTER_PORTABLE = 1
HOST_PAGE = mmap.PAGESIZE

# cudaError_t values a registration can meet, by name (torch binds cudaGetErrorString,
# which gives the sentence, but not cudaGetErrorName).
_ERROR_NAMES = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    46: "cudaErrorDevicesUnavailable",
    100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice",
    304: "cudaErrorOperatingSystem",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported",
    999: "cudaErrorUnknown",
}


class HostRegisterError(RuntimeError):
    """cudaHostRegister refused a range; the message names the CUDA error."""

    def __init__(self, code: int, description: str, ptr: int, nbytes: int):
        self.code = code
        name = _ERROR_NAMES.get(code, f"cudaError {code}")
        super().__init__(
            f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed: {name} ({code}): {description}"
        )


@dataclass
class Cudart:
    """The CUDA runtime calls pinning needs; each returns a cudaError_t as int."""

    host_register: Callable[[int, int, int], int]
    host_unregister: Callable[[int], int]
    error_string: Callable[[int], str]
    clear_error: Callable[[], None]


def torch_cudart() -> Cudart:
    """The real calls, through torch's cudart bindings."""
    rt = torch.cuda.cudart()
    codes: dict[int, object] = {}

    def register(ptr: int, nbytes: int, flags: int) -> int:
        result = rt.cudaHostRegister(ptr, nbytes, flags)
        codes[int(result)] = result  # cudaGetErrorString wants the enum object back
        return int(result)

    def unregister(ptr: int) -> int:
        result = rt.cudaHostUnregister(ptr)
        codes[int(result)] = result
        return int(result)

    def error_string(code: int) -> str:
        try:
            return str(rt.cudaGetErrorString(codes[code]))
        except Exception:  # noqa: BLE001 - a description is a nicety, never a new failure
            return "no description"

    return Cudart(register, unregister, error_string, _clear_last_error)


def _clear_last_error() -> None:
    """cudaGetLastError() on the cudart torch loaded, so a refused registration is not
    reported by torch as the error of its next, unrelated kernel launch.

    Best effort: torch binds no cudaGetLastError, so the loaded libcudart is looked up
    in /proc/self/maps (a second copy of cudart would keep its own last error).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def split_pieces(ptr: int, nbytes: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """(address, length) pieces of at most `piece_bytes` covering [ptr, ptr + nbytes)."""
    if nbytes <= 0 or piece_bytes <= 0:
        raise ValueError(f"cannot split {nbytes} bytes into pieces of {piece_bytes}")
    return [(ptr + off, min(piece_bytes, nbytes - off)) for off in range(0, nbytes, piece_bytes)]


def register_range(
    cudart: Cudart, ptr: int, nbytes: int, flags: int = HOST_REGISTER_DEFAULT, piece_bytes: int = PIECE_BYTES
) -> list[int]:
    """Register [ptr, ptr + nbytes) in pieces; returns the piece addresses (to unregister).

    All or nothing: on a failure the pieces already registered are unregistered before
    `HostRegisterError` is raised.
    """
    done: list[int] = []
    for piece, length in split_pieces(ptr, nbytes, piece_bytes):
        code = cudart.host_register(piece, length, flags)
        if code != 0:
            description = cudart.error_string(code)
            cudart.clear_error()
            for registered in reversed(done):
                if cudart.host_unregister(registered) != 0:
                    cudart.clear_error()
            raise HostRegisterError(code, description, piece, length)
        done.append(piece)
    return done


class Pinning:
    """Owns the registrations of one worker; `close()` undoes every one of them."""

    def __init__(
        self, cudart: Cudart | None = None, flags: int = HOST_REGISTER_DEFAULT, piece_bytes: int = PIECE_BYTES
    ):
        self._cudart = cudart
        self.flags = flags
        self.piece_bytes = piece_bytes
        self._pieces: dict[int, tuple[list[int], int]] = {}  # range start -> (piece addresses, bytes)
        self.failures = 0
        self.registered_bytes = 0
        self.seconds = 0.0
        self._logged_time = False

    @property
    def cudart(self) -> Cudart:
        if self._cudart is None:
            self._cudart = torch_cudart()
        return self._cudart

    def is_registered(self, ptr: int) -> bool:
        return ptr in self._pieces

    def register(self, tensor: torch.Tensor) -> bool:
        """Register a CPU tensor's bytes; False (logged once, counted) where CUDA refuses."""
        return self.register_range(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def register_range(self, ptr: int, nbytes: int) -> bool:
        if ptr in self._pieces:
            return True
        if ptr % HOST_PAGE == 0:
            nbytes = -(-nbytes // HOST_PAGE) * HOST_PAGE  # whole pages: see the module docstring
        start = time.perf_counter()
        try:
            pieces = register_range(self.cudart, ptr, nbytes, self.flags, self.piece_bytes)
        except HostRegisterError as exc:
            self.failures += 1
            level = logging.WARNING if self.failures == 1 else logging.DEBUG
            logger.log(
                level,
                "%s; copies from this memory go through pageable DMA (slower). An arena outside "
                "tmpfs (tiers.cpu.shm_dir on a disk filesystem) cannot be pinned: Linux refuses it",
                exc,
            )
            return False
        elapsed = time.perf_counter() - start
        self._pieces[ptr] = (pieces, nbytes)
        self.registered_bytes += nbytes
        self.seconds += elapsed
        if not self._logged_time:
            self._logged_time = True
            logger.info(
                "cudaHostRegister of %.2f GiB in %d piece(s) took %.3f s", nbytes / GIB, len(pieces), elapsed
            )
        return True

    def unregister(self, ptr: int) -> None:
        pieces, nbytes = self._pieces.pop(ptr, ([], 0))
        for piece in pieces:
            if self.cudart.host_unregister(piece) != 0:
                self.cudart.clear_error()
        self.registered_bytes -= nbytes

    def close(self) -> None:
        for ptr in list(self._pieces):
            self.unregister(ptr)
