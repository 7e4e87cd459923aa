"""Which models the continuous-batching connector serves, checked before anything is built.

The families the HF connector serves (:mod:`kvtier.connectors.hf_cache`; its refusals and
messages apply here first), restricted to those whose every layer is full attention with one
K/V shape: Llama (SmolLM2), Qwen2 without sliding layers, Qwen3, Mistral without
``sliding_window``. Refused by name:

- sliding-window and chunked layers: transformers' paged cache keeps a sliding layer's K/V in a
  ring buffer of ``ceil(window / page_size)`` pages per request
  (``continuous_batching/cache_allocators/sliding_attention.py``), so its pages do not hold
  one block of positions each, which kvtier's blocks and the layout's views assume;
- MLA layers (DeepSeek-V2/V3) and layers of unequal K/V shapes: the connector's strided views
  assume one ``[num_kv_heads, head_dim]`` shape for K and V in every layer.

Use :class:`kvtier.connectors.hf.HFConnector` (``model.generate``) for those families.
"""

from __future__ import annotations

import torch

from kvtier.connectors.hf_cache import UnsupportedModelError, kv_spec_for
from kvtier.types import KVSpec

__all__ = ["UnsupportedModelError", "check_model"]


def check_model(model: torch.nn.Module, block_size: int) -> KVSpec:
    """The model's block spec, if the connector serves it exactly.

    First the HF connector's family check (:func:`kvtier.connectors.hf_cache.kv_spec_for`:
    encoder-decoder, linear attention, Mamba, unknown cache layers refused, naming them), then
    this connector's: one full-attention layer group (the spec has no ``groups``), and no
    ``layer_types`` / ``sliding_window`` in the config that would make transformers' paged
    cache group the layers otherwise.

    Raises:
        UnsupportedModelError: the message names the model class and its layer kinds.
    """
    spec = kv_spec_for(model, block_size)
    name = type(model).__name__
    if spec.groups:
        raise UnsupportedModelError(
            f"{name}: kvtier's continuous-batching connector serves full-attention models only (one layer "
            f"group); this model's layers are {spec.layout_name}. Use HFConnector (model.generate) for it"
        )
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        kinds = set(layer_types)
    else:
        kinds = {"sliding_attention" if getattr(cfg, "sliding_window", None) is not None else "full_attention"}
    if kinds != {"full_attention"}:
        raise UnsupportedModelError(
            f"{name}: kvtier's continuous-batching connector serves full-attention models only; "
            f"the config gives layer types {sorted(kinds)}"
        )
    return spec
