"""The node store as plain Python components: no Ray, no vLLM (node_store.py says how it is built)."""
