"""The fault matrix and the soak: real engines under load while something breaks.

Outside the layers (like `kvstrata._dev.testing`): it drives vLLM, Ray and the store from
the outside, as an operator's tests would. `scripts/fault_matrix.py` and
`scripts/soak.py` are its command lines; docs/fault-matrix.md has the last tables.
"""
