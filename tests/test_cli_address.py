"""A bad `--address` fails every CLI command within seconds with a message naming it, never a
hang in `ray.init` (issue #51, finding 10). Nothing listens at the addresses used here."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvstrata import ray_address
from kvstrata.cli import main


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("command", [["status"], ["purge"], ["warm", "--model", "m", "--prompt-file", "PROMPT"]])
def test_a_dead_address_fails_within_seconds_naming_it(tmp_path, capsys, command):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    address = f"127.0.0.1:{closed_port()}"
    argv = [str(prompt) if arg == "PROMPT" else arg for arg in command]
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(main(["--address", address, *argv])), daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(ray_address.PROBE_SECONDS + 30)
    assert result == [2], f"{command[0]} did not fail within {time.monotonic() - started:.0f} s"
    err = capsys.readouterr().err
    assert address in err and "no Ray cluster answers" in err


def test_an_unknown_host_is_named():
    with pytest.raises(ray_address.Unreachable, match="nosuchhost.invalid:6379"):
        ray_address.check("nosuchhost.invalid:6379", timeout_s=2)
    with pytest.raises(ray_address.Unreachable, match="not host:port"):
        ray_address.check("justahost")
