"""The prepared GPU check: what `scripts/gpu_check.py` runs on a machine with a GPU.

GPU machines are lent rarely and briefly, and their image has torch, Triton and
cuda-bindings but no vLLM, no Ray and no pydantic. Everything here imports with torch
and numpy alone (a test blocks the rest in a subprocess), and has a CPU mode that CI runs,
so the check cannot rot between the machines that run it.

  * `layouts`: KV caches shaped as vLLM's attention backends allocate them, and the
    canonical view vLLM's offloading connector hands a worker;
  * `harness`: the worker's real transfer path (`CopyEngine.from_canonical`, then the
    `store` / `load` calls `StrataWorker` makes) through a real arena, interleaved with a
    compute stream, every byte checked;
  * `environment`: what the machine is (GPU, driver, link, copy backend, pinning).
"""
