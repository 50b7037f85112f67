"""`kvstrata` command: place, inspect, purge and take down the store of this node.

    kvstrata up --config configs/local.yaml     # ensure this node's store (joins Ray)
    kvstrata up --config configs/multinode.yaml # with a `cluster` section: a store on every
                                                # node, the directory and the reconciler
    kvstrata status                             # arena, pools, holders as JSON
    kvstrata purge [--namespace NS]             # drop chunks (pinned ones go when unpinned)
    kvstrata down [--config ...]                # unlink the arena and end the store (with a
                                                # `cluster` section: every store, the directory)
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstrata.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstrata", description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="Ray cluster address (default: the config's, else auto)")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="ensure a node store on this node")
    up.add_argument("--config", default=None, help="YAML tier config (default: built-in local config)")
    commands.add_parser("status", help="print this node's store state as JSON")
    purge = commands.add_parser("purge", help="drop stored chunks")
    purge.add_argument("--namespace", default=None, help="only this layout namespace")
    down = commands.add_parser("down", help="unlink the arena and end this node's store (or the cluster's)")
    down.add_argument("--config", default=None, help="YAML tier config; with a `cluster` section, take all down")
    args = parser.parse_args(argv)

    from kvstrata.actors.client import (
        StoreUnavailable,
        ensure_node_store,
        get_node_store,
        join_cluster,
        shutdown_node_store,
    )

    try:
        config = load_config(getattr(args, "config", None))
        join_cluster(args.address or config.ray.address)
        import ray

        if args.command == "up" and config.cluster is not None:
            from kvstrata.actors.cluster import up

            placed = up(config)
            print(f"kvstrata up on {len(placed['nodes'])} nodes, {placed['directory_shards']} directory shards")
        elif args.command == "up":
            store = ensure_node_store(config)
            print(f"kvstrata node store up (epoch {ray.get(store.ping.remote())})")
        elif args.command == "status":
            print(json.dumps(ray.get(get_node_store().stats.remote()), indent=2, default=str))
        elif args.command == "purge":
            print(f"purged {ray.get(get_node_store().purge.remote(args.namespace))} chunks")
        elif args.command == "down" and config.cluster is not None:
            from kvstrata.actors.cluster import down

            down(config)
            print("kvstrata down on every node")
        elif args.command == "down":
            shutdown_node_store(get_node_store())
            print("kvstrata node store down")
    except (ConfigError, StoreUnavailable) as exc:
        print(f"kvstrata: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
