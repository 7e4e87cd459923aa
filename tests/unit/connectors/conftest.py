"""Fixtures shared by the connector tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama (3 layers, 4 query heads, 2 KV heads, head_dim 16), one per module;
    a module that needs another model defines its own ``model`` fixture, which wins."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg).eval()
