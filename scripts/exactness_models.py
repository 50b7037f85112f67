"""The tiny random-weight models of the exactness matrix, one per model shape, built locally.

Every model shares the character-level tokenizer of `kvstrata._dev.testing` (one token per
character, so a prompt's length in tokens is its length in characters plus the BOS) and
head_dim 32 (the CPU build of vLLM wants >= 32). Weights are drawn with a fixed seed and
scaled up, so that logits depend visibly on every KV byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The shapes the matrix knows; `builders` says how each is made.
DENSE, SLIDING, FP8, HYBRID_SSM, MLA = "dense", "sliding+full", "dense-fp8kv", "mamba2-hybrid", "mla"


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvstrata._dev.testing import VOCAB

    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


def _save(directory: Path, model: Any, seed: int, patch: dict[str, Any] | None = None) -> Path:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 or name.endswith("bias"):
                parameter.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    if patch:
        config_file = directory / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **patch}, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _tokenizer(directory)
    return directory


COMMON = dict(vocab_size=128, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, max_position_embeddings=4096)


def build_hybrid_ssm(directory: Path, seed: int = 3) -> Path:
    """Granite 4.0 hybrid: a Mamba2 layer, then an attention layer, dense MLPs (no experts).

    vLLM 0.32 runs it natively (`GraniteMoeHybridForCausalLM`, with Mamba prefix caching);
    it has no Bamba model class any more (a Bamba checkpoint falls back to the Transformers
    backend, which refuses Mamba layers).
    """
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        **COMMON,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_local_experts=0,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=4,
        position_embedding_type="rope",
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=32,
        torch_dtype="float32",
    )
    return _save(directory, GraniteMoeHybridForCausalLM(config), seed)


def build_mla(directory: Path, seed: int = 4) -> Path:
    """DeepSeek-V2 style multi-head latent attention, dense MLPs (no experts)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        **COMMON,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,  # vLLM's MLA takes a latent + rope width of 320, 512 or 576 only
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        torch_dtype="float32",
    )
    return _save(directory, DeepseekV2ForCausalLM(config), seed)


def build(shape: str, root: Path) -> tuple[Path, dict[str, Any]]:
    """The model directory of `shape` under `root` (built once) and the engine arguments it needs."""
    from kvstrata._dev.testing import build_tiny_llama

    root.mkdir(parents=True, exist_ok=True)
    if shape in (DENSE, FP8):
        model = build_tiny_llama(root / "dense", seed=11)
        return model, ({"kv_cache_dtype": "fp8"} if shape == FP8 else {})
    if shape == SLIDING:
        return build_tiny_llama(root / "sliding", seed=12, num_layers=4, sliding_window=64), {}
    directory = root / shape
    if (directory / "config.json").exists():
        return directory, {}
    directory.mkdir(parents=True, exist_ok=True)
    if shape == HYBRID_SSM:
        return build_hybrid_ssm(directory), {}
    if shape == MLA:
        return build_mla(directory), {}
    raise ValueError(f"unknown model shape {shape!r}")


def build_lora(model_dir: Path, directory: Path, rank: int = 8, seed: int = 21) -> Path:
    """A LoRA adapter for the attention projections (Llama: q/k/v/o; MLA: q, the latent's
    kv_a_proj_with_mqa, o), written in PEFT's format.

    Random A and B (PEFT starts B at zero, which would change nothing): the adapter changes
    K and V, so a KV page stored under it must never serve a request without it."""
    import torch
    from safetensors.torch import save_file

    if (directory / "adapter_config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    if "kv_lora_rank" in config:  # MLA: the latent (and so the stored KV) goes through kv_a_proj_with_mqa
        rope = config["qk_rope_head_dim"]
        shapes = {  # module -> (in, out)
            "q_proj": (hidden, heads * (config["qk_nope_head_dim"] + rope)),
            "kv_a_proj_with_mqa": (hidden, config["kv_lora_rank"] + rope),
            "o_proj": (heads * config["v_head_dim"], hidden),
        }
    else:
        kv = config["num_key_value_heads"] * config.get("head_dim", hidden // heads)
        shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, (fan_in, out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.1
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(shapes),
        "task_type": "CAUSAL_LM",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    return directory
