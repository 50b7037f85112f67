"""Ray glue: the node store that owns one node's tiers, and how it is placed.

Importing this package does not import Ray; only `client` does, lazily.
"""
