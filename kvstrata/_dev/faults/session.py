"""What the fault matrix and the soak run inside: a tiny model on disk and a local Ray
cluster on loopback, both released when the session ends (also on failure)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

# The environment every row's engine needs here: loopback Ray, no Hub, quiet vLLM, and a
# CPU KV cache small enough for two engines on a 24 GiB machine.
SESSION_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def set_session_env() -> None:
    """Set what SESSION_ENV names unless the caller set it already (before vLLM is imported)."""
    for name, value in SESSION_ENV.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def fault_session(namespace: str, seed: int = 11) -> Iterator[Path]:
    """Yield the tiny model's directory with a fresh local Ray cluster running."""
    from kvstrata._dev.testing import build_tiny_llama, local_ray

    set_session_env()
    with tempfile.TemporaryDirectory(prefix="kvstrata-fault-model-") as scratch:
        model = build_tiny_llama(Path(scratch) / "tiny", seed=seed)
        with local_ray(namespace):
            yield model
