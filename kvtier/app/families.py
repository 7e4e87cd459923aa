"""Tiny random-weight models of every model family the HF connector serves (and of some it
refuses), for the demo (``kvtier demo --model tiny-<family>``) and the tests: the real architectures (transformers classes and their
config fields) at a few layers, hidden size 64, vocab 256, float32, seeded.

Sliding windows and chunks are 7 or 8 tokens, so prompts of a few dozen tokens really slide
(positions drop out of the window; tests check the masks change the output). Weights are
transformers' default initialisation: logits of magnitude ~0.5, whose float32 rounding noise
between a full prefill and a suffix prefill is ~1e-7, while greedy top-1/top-2 margins on the
test prompts are >= 1e-3.

    model = tiny_model("gemma3")          # Gemma3ForCausalLM, 4 layers: 3 sliding + 1 full
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when a model is built: `kvtier --help` does not pay for it
    import torch

VOCAB_SIZE = 256
_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Family:
    """One model family: its transformers config class and the fields that make it that family.

    Attributes:
        name: short name (``llama``, ``gemma3``, ...).
        config_class: name of the transformers config class.
        fields: config fields on top of the shared tiny sizes.
        attention: attention kinds of its layers, as the README's family table says.
        supported: the HF connector serves it (else ``from_model`` refuses it).
        refusal: text the refusal error names (a layer type or class), for refused families.
    """

    name: str
    config_class: str
    fields: dict[str, Any] = field(default_factory=dict)
    attention: str = "full"
    supported: bool = True
    refusal: str = ""

    def config(self) -> Any:
        import transformers

        return getattr(transformers, self.config_class)(**{**_COMMON, **self.fields})


_ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_MLA = dict(
    num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
    topk_group=1, moe_intermediate_size=32,
)

SUPPORTED: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig"),
        Family("qwen2", "Qwen2Config", dict(use_sliding_window=True, sliding_window=7, max_window_layers=2),
               "full + sliding (layer_types)"),
        Family("qwen3", "Qwen3Config", dict(head_dim=16)),
        Family("mistral", "MistralConfig", dict(sliding_window=7), "sliding"),
        Family("gemma2", "Gemma2Config", dict(sliding_window=8, head_dim=16, layer_types=_ALTERNATING),
               "sliding + full (softcapping)"),
        Family("gemma3", "Gemma3TextConfig",
               dict(sliding_window=8, head_dim=16, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
               "sliding + full (per-type RoPE)"),
        Family("gpt-oss", "GptOssConfig",
               dict(sliding_window=8, head_dim=16, num_local_experts=4, num_experts_per_tok=2, layer_types=_ALTERNATING),
               "sliding + full (attention sinks)"),
        Family("llama4", "Llama4TextConfig",
               dict(head_dim=16, attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=128),
               "chunked + full"),
        Family("deepseek-v3", "DeepseekV3Config", _MLA, "MLA"),
    )
}

REFUSED: dict[str, Family] = {
    f.name: f
    for f in (
        Family("mamba", "MambaConfig", dict(state_size=8), "Mamba (SSM)", False, "LinearAttentionLayer"),
        Family("jamba", "JambaConfig",
               dict(num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                    expert_layer_offset=1, mamba_d_state=8, mamba_expand=2, mamba_dt_rank=8),
               "Mamba + full", False, "linear_attention"),
        Family("bamba", "BambaConfig",
               dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8),
               "Mamba2 + full", False, "linear_attention"),
        Family("qwen3-next", "Qwen3NextConfig",
               dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32),
               "linear attention + full", False, "linear_attention"),
        Family("t5", "T5Config", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
               "encoder-decoder", False, "encoder-decoder"),
    )
}


def tiny_model(name: str, seed: int = 0, **overrides: Any) -> "torch.nn.Module":
    """A seeded float32 random-weight model of family ``name`` (``SUPPORTED`` or
    ``REFUSED``), in eval mode. ``overrides`` replace config fields.

    Raises:
        KeyError: an unknown family name.
    """
    import torch
    import transformers

    family = SUPPORTED.get(name) or REFUSED[name]
    config = family.config()
    for key, value in overrides.items():
        setattr(config, key, value)
    auto = transformers.AutoModelForSeq2SeqLM if family.name == "t5" else transformers.AutoModelForCausalLM
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = auto.from_config(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()
