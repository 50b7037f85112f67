"""How many tokens a sliding-window model's hit serves around a chunk boundary: kvstrata
against vLLM's own CPU offloading, the same prompts on the same model in one run.

Why: on the exactness matrix's sliding-window model (a 64-token window on even layers,
full attention on odd ones), a prompt computed to exactly a chunk boundary came back one
chunk short (128 of 192 tokens), and so did its extension. This probe shows that vLLM's
own offloading (its connector and `CPUOffloadingManager`, `kvstrata._dev.vllm_cpu_reference`)
serves the same: the rule is vLLM's scheduler's, and `exactness_design.expected_hit`
follows it. Each line: the engine, the tokens computed first, the tokens asked again after
the engine's prefix cache was reset, and how many of them were cached.

    .venv/bin/python scripts/exactness_swa_probe.py      # about 2 minutes, two engine starts
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exactness_matrix import ENV  # noqa: E402

# (computed first, asked again): around the boundary of 3 chunks of 64 tokens
CASES = ((191, 191), (192, 192), (192, 232), (193, 193), (224, 224))


def main() -> int:
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    import exactness_design as design
    from exactness_models import SLIDING
    from exactness_run import Matrix, prompt

    from kvstrata._dev.vllm_cpu_reference import reference_transfer
    from kvstrata.quiet import quiet_output

    with quiet_output("exactness_swa_probe") as out, Matrix(need_peer=False, need_bucket=False) as matrix:
        _, kwargs = matrix.engine_kwargs(SLIDING, 1, "none", lora=False)
        for engine in ("kvstrata", "vLLM's own offloading"):
            if engine == "kvstrata":
                llm = matrix.start(kwargs, kvstrata=True)
            else:
                own = dict(kwargs, kv_transfer_config=reference_transfer(64 << 20, block_size=design.CHUNK))
                llm = matrix.start(own, kvstrata=False)
            try:
                for computed, served in CASES:
                    tokens = prompt(f"{engine} {computed} {served}", served, seed=served)
                    before = matrix.snapshot()
                    matrix.generate(llm, [tokens[:computed]])
                    if engine == "kvstrata":
                        matrix.settle(llm, before, computed // design.CHUNK)
                    else:  # the reference copies synchronously; a few steps finish its store jobs
                        for tick in range(3):
                            matrix.tick(llm, seed=tick)
                    llm.reset_prefix_cache()
                    (hit,) = matrix.generate(llm, [tokens])
                    print(f"{engine}: computed {computed}, asked {served}: {hit.cached} cached "
                          f"(expected_hit rule: {design.expected_hit_tokens(computed, served, SLIDING)})", file=out, flush=True)  # fmt: skip
            finally:
                matrix.stop(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
