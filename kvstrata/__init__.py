"""kvstrata: a Ray-based, tiered KV-cache store for vLLM.

The public surface is small: the spec selected in vLLM's `kv_connector_extra_config`
(`spec_name: StrataSpec`, `spec_module_path: kvstrata.connector`), the YAML schema in
`kvstrata.config`, and `kvstrata.up()` to place the node stores. Importing this
package starts nothing.
"""

__version__ = "0.1.0"


def up(config=None, address: str | None = None):
    """Ensure a node store on this node; returns its actor handle (see `kvstrata.actors`)."""
    from kvstrata.actors.client import ensure_node_store, join_cluster
    from kvstrata.config import load_config

    cfg = load_config(config)
    join_cluster(address or cfg.ray.address)
    return ensure_node_store(cfg)
