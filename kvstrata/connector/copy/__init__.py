"""The copy engine's parts: one descriptor builder for every device, and the executors
that move a transfer's descriptors (host row copies, batched CUDA DMA, a Triton kernel).

Torch, numpy and (optionally) Triton / cuda-bindings only: no vLLM, no Ray, so the GPU
benchmark machine runs exactly the code that ships.

Every executor has the same small interface (`Executor`): `submit` a transfer's
descriptors under a job id, poll `finished`, `wait` until named jobs no longer touch
their buffers, `close`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstrata.connector.copy.descriptors import Descriptors


@dataclass
class Completed:
    """One finished transfer: its job id, whether every byte moved, how many, how long."""

    job_id: int
    success: bool
    num_bytes: int
    seconds: float


class Executor(Protocol):
    """What the copy engine asks of whatever moves descriptors (host threads, CUDA)."""

    def submit(self, job_id: int, direction: str, desc: Descriptors) -> None: ...

    def finished(self) -> list[Completed]: ...

    def wait(self, job_ids: set[int]) -> None: ...

    def close(self) -> None: ...
