"""Whether a Ray cluster address answers at all, before `ray.init` is asked to join it.

Why: `ray.init(address="host:port")` with nothing listening there waits for the GCS for
minutes (measured here: over 90 s, then more), so every CLI command given a mistyped
`--address` hung. A TCP connection with a deadline tells a refused port, an unknown host
or an unreachable one in `PROBE_SECONDS` at most, with a message naming the address.
"auto" is resolved as Ray resolves it (RAY_ADDRESS, else the address Ray's last `ray start`
on this machine wrote down); Ray's own "no running instance" error stays Ray's.

Must not: join or start anything; import Ray at module level.
"""

from __future__ import annotations

import os
import socket

PROBE_SECONDS = 5.0


class Unreachable(ConnectionError):
    """Nothing answers at the cluster address; says which address and why."""


def resolve(address: str | None) -> str | None:
    """The host:port `address` stands for, or None where Ray decides alone (local, ray://)."""
    if address in (None, "", "auto"):
        address = os.environ.get("RAY_ADDRESS") or _last_started()
    if not address or address == "local" or "://" in address:
        return None
    return address


def check(address: str | None, timeout_s: float = PROBE_SECONDS) -> None:
    """Raise `Unreachable` unless something accepts a TCP connection at `address`'s GCS port."""
    target = resolve(address)
    if target is None:
        return
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise Unreachable(f"Ray address {target!r} is not host:port")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except OSError as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
        raise Unreachable(
            f"no Ray cluster answers at {target!r} ({why} within {timeout_s:g} s); check --address / "
            f"`ray.address` / RAY_ADDRESS, or start one with `ray start --head`"
        ) from None


def _last_started() -> str | None:
    try:
        from ray._private.utils import read_ray_address  # Ray's own "auto" lookup (a private helper)

        return read_ray_address()
    except Exception:  # noqa: BLE001 - another Ray: let ray.init resolve "auto" itself
        return None
