"""`kvstrata` command: start, inspect, measure, purge and take down the node stores.

    kvstrata up --config configs/local.yaml     # this node's store; checks every configured tier
    kvstrata up --config configs/multinode.yaml # with a `cluster` section: a store on every
                                                # node, the directory and the reconciler
    kvstrata status [--node ID] [--json] [--watch [S]]   # tables per node and tier
    kvstrata bench --config configs/local.yaml  # tier throughput on this node, beside references
    kvstrata purge [--namespace NS]             # drop chunks (pinned ones go when unpinned)
    kvstrata warm --model M --prompt-file F [--ttl 1h]   # a prompt's KV into this node's arena
    kvstrata down [--config ...]                # unlink the arena and end the store (with a
                                                # `cluster` section: every store, the directory)

`up` and `down` also unlink the `kvstrata-*` segments in this machine's `shm_dir` that no
live store holds (left by stores that died with their Ray cluster); `down` does so even
when no Ray cluster or store is left, and then exits 0.

Exit codes: 0 done; 1 `up` found a configured tier that cannot work (unless
`--allow-degraded`); 2 bad config or no store / no Ray cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from rich.console import Console

from kvstrata.bench import add_bench_arguments
from kvstrata.config import ConfigError, KvstrataConfig, load_config

PURGE_TIMEOUT_SECONDS = 600.0  # a purge returns once the arena and disk forgot; the bucket empties after
STATUS_TIMEOUT_SECONDS = 10.0
PIPED_WIDTH = 200


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (default: the config's, else auto)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, description: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=description, description=description)

    up = command(
        "up",
        "Ensure this node's store (or, with a `cluster` section, every node's, the directory and the "
        "reconciler), then check every configured tier: a tier that cannot work is named with its "
        "reason and the exit code is 1.",
    )
    up.add_argument("--config", default=None, help="YAML tier config (default: built-in local config)")
    up.add_argument("--allow-degraded", action="store_true", help="exit 0 even if a configured tier cannot work")
    status = command(
        "status",
        "Per node and tier: capacity, use, chunks, hits and misses, GB/s over the last minute, "
        "errors, namespaces with their models, engines with leases and pins. Every node when a "
        "cluster directory exists, else this node.",
    )
    status.add_argument("--node", default=None, help="only this Ray node id")
    status.add_argument("--json", action="store_true", help="the stores' raw stats as JSON (machine-readable)")
    status.add_argument(
        "--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )  # fmt: skip
    bench = command(
        "bench",
        "Measure write and read throughput of the configured tiers on this node, each beside a "
        "reference measured in the same run (memcpy, raw disk, raw object client), with a "
        "progress bar, on scratch space it removes afterwards.",
    )
    bench.add_argument("--config", default=None, help="YAML tier config (default: built-in local config)")
    add_bench_arguments(bench)
    purge = command("purge", "Drop stored chunks from every tier of this node's store (pinned ones go when unpinned).")
    purge.add_argument("--namespace", default=None, type=_namespace_argument, help="only this layout namespace")
    warm = command(
        "warm",
        "Bring a prompt's KV into a node's arena before it is asked for (held for its first use), named "
        "as the model's engines on that node name it; with --ttl also retain it there and on disk.",
    )
    warm.add_argument("--model", required=True, help="the model as its engines were given it (path or hub id)")
    warm.add_argument("--prompt-file", required=True, help="the prompt's text (with --chat: a JSON list of messages)")
    warm.add_argument("--ttl", default=None, type=_ttl_argument, help="retain it this long: seconds, or 5m, 1h, 24h")
    warm.add_argument("--priority", default=50, type=int, choices=range(1, 101), metavar="1-100", help="retention priority")
    warm.add_argument("--pin", action="store_true", help="pin it until unpinned (within the tenant's pin quota)")
    warm.add_argument("--chat", action="store_true", help="the file is chat messages, rendered by the chat template")
    warm.add_argument("--tokenizer", default=None, help="where to load the tokenizer from (default: --model)")
    warm.add_argument("--cache-salt", default=None, help="the requests' cache_salt, if they set one")
    warm.add_argument("--tenant", default="", help="the engines' namespace_prefix (default: the default tenant, '')")
    warm.add_argument("--node", default=None, help="the Ray node whose store to warm (default: this node)")
    warm.add_argument("--wait", default=30.0, type=float, help="seconds to wait for the chunks to land (0: do not)")
    down = command("down", "Unlink the arena and end this node's store (with a `cluster` section: every store and the directory).")
    down.add_argument("--config", default=None, help="YAML tier config; with a `cluster` section, take all down")
    return parser


def _namespace_argument(value: str) -> str:
    """A `--namespace` the store would accept; anything else exits 2 naming it, before any
    store is reached (an empty one would once have purged every tenant's objects)."""
    from kvstrata.namespaces import check_namespace

    try:
        return check_namespace(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ttl_argument(value: str) -> float:
    from kvstrata.tiers.retention import parse_ttl

    try:
        return parse_ttl(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # piped or captured: one line per table row, for grep
        console = Console(width=PIPED_WIDTH)
    from kvstrata.actors.client import StoreUnavailable, join_cluster

    try:
        config = load_config(getattr(args, "config", None))
        if args.command == "bench":
            return _bench(config, console, args)
        if args.command == "down":
            return _down(config, console, args)
        if args.command == "up":
            _reclaim_orphans(config, console, "found by `kvstrata up`")
        if args.command == "warm":
            return _warm(config, console, args)
        join_cluster(args.address or config.ray.address, logging_level=logging.WARNING)
        if args.command == "up":
            return _up(config, console, args.allow_degraded)
        if args.command == "status":
            return _status(console, args)
        return _purge_or_down(config, console, args)
    except (ConfigError, StoreUnavailable) as exc:
        print(f"kvstrata: {exc}", file=sys.stderr)  # one unwrapped line, whatever the terminal
        return 2


def _up(config: KvstrataConfig, console: Console, allow_degraded: bool) -> int:
    from kvstrata.actors.client import RayStoreClient, ensure_node_store, named_actors
    from kvstrata.actors.options import STORE_NAME_PREFIX

    if config.cluster is not None:
        from kvstrata.actors.cluster import up

        placed = up(config)
        console.print(f"kvstrata up on {len(placed['nodes'])} nodes, {placed['directory_shards']} directory shards")
        stores = named_actors(STORE_NAME_PREFIX)
    else:
        stores = {"this node": ensure_node_store(config)}
    object_problem = _probe_object_store(config)
    problems = int(object_problem is not None)
    not_started = 0  # no store at all: --allow-degraded does not accept that
    for node, store in sorted(stores.items()):
        try:
            stats = RayStoreClient(store, STATUS_TIMEOUT_SECONDS).stats()
        except Exception as exc:  # noqa: BLE001 - e.g. its constructor raised: say so, exit 1
            cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            console.print(f"  [bold red]FAILED[/] node store on {node} did not start: {cause}", highlight=False)
            not_started += 1
            continue
        disk = stats["report"]["tiers"]["disk"]
        found = {"disk": disk["reason"]} if disk["state"] == "error" else {}
        if object_problem is not None:
            found["object"] = object_problem
        console.print(f"node store up on node {stats['node_id']} (pid {stats['pid']}, epoch {stats['epoch']})", highlight=False)
        for line, ok in _tier_lines(config, found):
            console.print(f"  [{'green' if ok else 'bold red'}]{'ok ' if ok else 'FAILED'}[/] {line}", highlight=False)
        if damaged := (stats.get("disk") or {}).get("damaged_files"):
            console.print(f"  [yellow]note[/] disk: {damaged} damaged file(s) set aside into damaged/", highlight=False)
        problems += "disk" in found
    if not_started:
        console.print(f"[bold red]{not_started} node store(s) did not start[/]; nothing is cached there.", highlight=False)
        return 1
    if problems and not allow_degraded:
        console.print(
            f"[bold red]{problems} configured tier(s) cannot work[/]; the store serves without them. "
            "Fix the config (or pass --allow-degraded to accept this).",
            highlight=False,
        )
        return 1
    return 0


def _probe_object_store(config: KvstrataConfig) -> str | None:
    """Why the configured object store cannot be written, or None. Probed once, from this
    process: the bucket is shared, and a store actor busy with a probe against a slow or
    black-holed endpoint would keep its engines' control calls waiting."""
    if config.tiers.object is None:
        return None
    from kvstrata.tiers.object_store import ObjectTier

    tier = ObjectTier(config.tiers.object)
    try:
        return tier.probe(f"up-{os.getpid()}")
    finally:
        tier.close()


def _tier_lines(config: KvstrataConfig, problems: dict[str, str]) -> list[tuple[str, bool]]:
    tiers = config.tiers
    lines = [(f"cpu arena: {tiers.cpu.capacity:,} bytes in {tiers.cpu.shm_dir}", True)]
    if tiers.disk is not None:
        where = f"disk: {tiers.disk.path} ({tiers.disk.capacity:,} bytes, {tiers.disk.write_policy})"
        lines.append((f"{where}: {problems['disk']}" if "disk" in problems else where, "disk" not in problems))
    if tiers.object is not None:
        where = f"object store: {tiers.object.write_policy}, a probe object written and deleted"
        lines.append((f"object store: {problems['object']}" if "object" in problems else where, "object" not in problems))
    return lines


def _status(console: Console, args: argparse.Namespace) -> int:
    from kvstrata.cli.status_view import render_status

    if args.watch is None:
        stores, shards = _gather(args.node)
        if args.json:
            print(json.dumps(stores if len(stores) != 1 else stores[0], indent=2, default=str))
        else:
            console.print(render_status(stores, shards))
        return 0
    from rich.live import Live

    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                stores, shards = _gather(args.node)
                live.update(render_status(stores, shards), refresh=True)
                _wait(args.watch)
        except KeyboardInterrupt:
            pass
    return 0


def _gather(node: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Stats of the stores to show (one node, every node when a directory exists, else
    this node's) and of the directory shards."""
    import ray

    from kvstrata.actors.client import RayStoreClient, get_node_store, named_actors
    from kvstrata.actors.directory import DIRECTORY_NAME_PREFIX
    from kvstrata.actors.options import STORE_NAME_PREFIX

    shards = named_actors(DIRECTORY_NAME_PREFIX)
    if node is not None:
        stores = {node: get_node_store(node)}
    elif shards:
        stores = named_actors(STORE_NAME_PREFIX)
    else:
        stores = {"this node": get_node_store()}
    stats = [RayStoreClient(store, STATUS_TIMEOUT_SECONDS).stats() for _, store in sorted(stores.items())]
    directory = [ray.get(shard.stats.remote(), timeout=STATUS_TIMEOUT_SECONDS) for shard in shards.values()]
    return stats, directory


def _warm(config: KvstrataConfig, console: Console, args: argparse.Namespace) -> int:
    """Read the prompt (a missing file fails before any cluster is joined), then warm it."""
    from kvstrata.actors.client import join_cluster
    from kvstrata.warm import WarmError, chat_messages, warm

    try:
        with open(args.prompt_file, encoding="utf-8") as file:
            prompt = file.read()
        if args.chat:
            chat_messages(prompt)  # a file that is no chat fails here, before any cluster is joined
    except UnicodeDecodeError as exc:
        print(f"kvstrata warm: {args.prompt_file} is not UTF-8 text (byte {exc.start}: {exc.reason})", file=sys.stderr)
        return 2
    except WarmError as exc:
        print(f"kvstrata warm: {args.prompt_file}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvstrata warm: {exc}", file=sys.stderr)
        return 2
    try:
        join_cluster(args.address or config.ray.address, logging_level=logging.WARNING)
        reports = warm(
            args.model, prompt, ttl_s=args.ttl, priority=args.priority, pin=args.pin, chat=args.chat,
            tokenizer=args.tokenizer, cache_salt=args.cache_salt, node_id=args.node, wait_s=args.wait,
            tenant=args.tenant,
        )  # fmt: skip
    except (OSError, WarmError) as exc:
        print(f"kvstrata warm: {exc}", file=sys.stderr)
        return 2
    for report in reports:
        asked = report.get("pin") or report.get("prefetch") or {}
        refused = ", ".join(f"{n} {why[len('refused_'):]}" for why, n in asked.items() if why.startswith("refused_"))
        retained = f"; retained {report['retain']['retained']} for {args.ttl:g}s" if "retain" in report else ""
        console.print(
            f"namespace {report['namespace']}: {report['tokens']} tokens, {report['chunks']} chunks, "
            f"{report['held']} held in the arena{f' (refused: {refused})' if refused else ''}{retained}",
            highlight=False,
        )
    return 0


def _wait(seconds: float) -> None:
    import threading

    threading.Event().wait(seconds)  # a refresh period, not synchronisation


def _bench(config: KvstrataConfig, console: Console, args: argparse.Namespace) -> int:
    from kvstrata.bench import run_bench

    return run_bench(config, console, args)


def _purge_or_down(config: KvstrataConfig, console: Console, args: argparse.Namespace) -> int:
    from kvstrata.actors.client import get_node_store, shutdown_node_store, store_client

    if args.command == "purge":
        console.print(f"purged {store_client(timeout_s=PURGE_TIMEOUT_SECONDS).purge(args.namespace)} chunks")
    elif config.cluster is not None:
        from kvstrata.actors.cluster import down

        down(config)
        console.print("kvstrata down on every node")
    else:
        shutdown_node_store(get_node_store())
        console.print("kvstrata node store down")
    return 0


def _down(config: KvstrataConfig, console: Console, args: argparse.Namespace) -> int:
    """Take the stores down, then reclaim what dead stores left in this machine's `shm_dir`.
    With no Ray cluster or no store left (a cluster that died), only the reclaim: exit 0."""
    from kvstrata.actors.client import StoreUnavailable, join_cluster

    try:
        join_cluster(args.address or config.ray.address, logging_level=logging.WARNING)
        _purge_or_down(config, console, args)
    except StoreUnavailable as exc:
        console.print(f"no kvstrata store to take down: {str(exc).split('. ')[0]}", highlight=False)
    _reclaim_orphans(config, console, "found by `kvstrata down`")
    return 0


def _reclaim_orphans(config: KvstrataConfig, console: Console, why: str) -> None:
    """Unlink the segments no live store holds (see kvstrata.tiers.orphans); one line if any."""
    from kvstrata.tiers.orphans import reclaim_orphans

    found = reclaim_orphans(config.tiers.cpu.shm_dir, why=why)
    if found.files:
        console.print(
            f"reclaimed {len(found.files)} segment(s) in {config.tiers.cpu.shm_dir} left by stores that died: "
            f"{found.bytes:,} bytes freed",
            highlight=False,
        )


if __name__ == "__main__":
    sys.exit(main())
