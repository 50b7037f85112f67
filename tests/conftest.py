import os

# Every Ray listener on loopback (measured: the node IP becomes 127.0.0.1).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


import shutil  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402

import fsspec  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def memory_bucket():
    """A fresh fsspec memory:// object-store root, emptied after the test."""
    url = f"memory://kvstrata-{uuid.uuid4().hex[:8]}/kv"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture(autouse=True, scope="session")
def fingerprint_cache(tmp_path_factory):
    """Model fingerprints remembered by the tests' engines go to a test folder, not the user's cache
    (set in the environment, so engine processes, Ray workers and actors inherit it)."""
    previous = os.environ.get("KVSTRATA_CACHE_DIR")
    os.environ["KVSTRATA_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvstrata-cache"))
    yield
    if previous is None:
        os.environ.pop("KVSTRATA_CACHE_DIR", None)
    else:
        os.environ["KVSTRATA_CACHE_DIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def vllm_ipc_sockets():
    """vLLM names its engines' ZMQ sockets /tmp/<uuid> and leaves them behind: the tests' engines
    make theirs in a folder of the session's, removed at its end (short: a socket's path has at
    most 107 characters). In the environment, so engine cores and Serve replicas inherit it."""
    previous = os.environ.get("VLLM_RPC_BASE_PATH")
    folder = tempfile.mkdtemp(prefix="kvstrata-vllm-ipc-")
    os.environ["VLLM_RPC_BASE_PATH"] = folder
    yield
    if previous is None:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
    else:
        os.environ["VLLM_RPC_BASE_PATH"] = previous
    shutil.rmtree(folder, ignore_errors=True)
