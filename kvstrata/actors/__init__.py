"""Ray glue: the node store's actor (node_actor.py, over the plain kvstrata.store), the peer
link, the directory, the cluster and the client (`RayStoreClient`, the only code that
calls a store's handle).

Importing this package does not import Ray; only `client` does, lazily.
"""
