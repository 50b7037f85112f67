"""Helpers for tests, examples and benchmarks: a tiny random-weight Llama built locally.

No download is possible (or wanted) in CI, so the model and a character-level
tokenizer are written to a directory at run time. The sizes respect the CPU build of
vLLM: head_dim >= 32.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

VOCAB = ["<unk>", "<s>", "</s>"] + list(string.ascii_letters + string.digits + string.punctuation + " \n")


def build_tiny_llama(directory: str | Path, seed: int = 0, hidden_size: int = 128, num_layers: int = 2) -> Path:
    """Write a random-weight Llama (head_dim 32) and its tokenizer to `directory`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "config.json").exists():
        return directory

    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=hidden_size // 32,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger-than-default weights make logits depend visibly on every KV byte.
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory
