"""The copy engine's parts: one descriptor builder for every device, and the executors
that move a transfer's descriptors (host row copies, batched CUDA DMA, a Triton kernel).

Torch, numpy and (optionally) Triton / cuda-bindings only: no vLLM, no Ray, so the GPU
benchmark machine runs exactly the code that ships.
"""
