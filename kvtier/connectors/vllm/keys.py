"""Keys for vLLM requests: the engine-wide key fields, per-request roots, chained hashes.

Both sides of the connector derive the same keys from the same ``VllmConfig`` (the scheduler
hashes, the worker's store checks every DISK/REMOTE record against its namespace):

- :class:`EngineKey` holds what is fixed for an engine: model id, weights fingerprint, K/V
  dtype, block layout, ``block_size``, TP size, the hash function and the K/V-relevant
  fields of the model config as vLLM runs it (:func:`kv_config_for`: after ``hf_overrides``).
- The store namespace of TP rank ``r`` is ``KeyContext(**engine fields, tp_rank=r)``.
- A request's chain root adds what varies per request, LoRA adapter and ``cache_salt``:
  ``KeyContext(..., tp_rank=r, lora_name, lora_version, cache_salt).namespace()``. Two tenants
  (or adapters) never share a block, while every record still carries the rank's namespace.
- ``block_hash[i]`` chains over the request's tokens from that root
  (:func:`kvtier.hashing.hash_block_tokens`), so hashes are the same in every process and
  after restarts, and a restarted engine or another replica on the same DISK/REMOTE tier hits.
  Beside it, the block's token fingerprint chains from the same root
  (:func:`kvtier.hashing.key_block_tokens`): the store keeps it with the block and serves a
  block only to a request whose tokens give the same fingerprint.
- Media (images): every block holding placeholder tokens of an item gets the item's vLLM
  identifier (its ``mm_hash``, LoRA-prefixed when vLLM says so) and offset as extra keys
  (:mod:`kvtier.media`, :func:`request_media`), so the same token ids with another image miss.
  vLLM embeds an item whose placeholders start before ``num_computed_tokens`` from its encoder
  cache, so a hit may end inside an image. A request with an item vLLM gave no identifier is
  not cached.

No vLLM import here: the functions take the config objects and read plain attributes.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.hashing import KeyContext, key_block_tokens
from kvtier.media import MediaItem, block_extra_keys, check_items
from kvtier.model_keys import kv_config_bytes, kv_config_fields
from kvtier.types import BlockHash, Fingerprint

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files whose bytes change the model's K/V, hashed by :func:`model_fingerprint` (with
``config.json``)."""

_CHUNK_BYTES = 64 << 20


@functools.lru_cache(maxsize=8)
def model_fingerprint(model_dir: str) -> str:
    """xxh3-128 hex digest of a local model directory: ``config.json`` and every weight file
    (name, size and bytes; 64 MiB at a time, ~0.1 s per GB). Two checkpoints of one
    architecture, or one checkpoint with another RoPE config, never share blocks.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory.
    """
    import xxhash

    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"expected a model directory, got {model_dir!r}")
    digest = xxhash.xxh3_128()
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and (p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))
    )
    for path in files:
        digest.update(f"{path.relative_to(root)}|{path.stat().st_size}|".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def model_revision_for(model_config: Any, override: str | None = None) -> str:
    """The ``model_revision`` key field: ``override`` when given; else the fingerprint of the
    model directory (a local path, or the Hugging Face snapshot already on disk); else
    ``"<hub revision or 'main'>"`` with a warning (weights are then identified by name only).
    """
    if override:
        return override
    model = str(model_config.model)
    if os.path.isdir(model):
        return model_fingerprint(os.path.abspath(model))
    revision = getattr(model_config, "revision", None)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(model, revision=revision, local_files_only=True)
        return model_fingerprint(path)
    except Exception:  # noqa: BLE001  (not downloaded, not a hub id, offline: fall back to the name)
        logger.warning("kvtier: cannot fingerprint %s; keying its blocks by name and revision only", model)
        return f"hub:{revision or 'main'}"


def kv_config_for(vllm_config: Any) -> bytes:
    """The ``kv_config`` key field of an engine: the K/V-relevant fields of the config vLLM
    runs (``model_config.hf_config``, which already holds every ``hf_overrides`` entry, flat
    or nested, e.g. a RoPE scaling override; its text config for a multimodal model), the K/V
    cache dtype (``cache_config.cache_dtype``: ``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``;
    and whether its scales are computed) and the engine settings that change attention
    (``disable_sliding_window``, ``quantization``)."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    return kv_config_bytes(kv_config_fields(
        model_config.hf_config,
        kv_cache_dtype=str(cache_config.cache_dtype),
        calculate_kv_scales=bool(getattr(cache_config, "calculate_kv_scales", False)),
        disable_sliding_window=bool(getattr(model_config, "disable_sliding_window", False)),
        quantization=getattr(model_config, "quantization", None),
    ))


@dataclass(frozen=True)
class EngineKey:
    """The key fields fixed for one engine (see the module docstring).

    Attributes:
        model_id: model name as served (``served_model_name``, else the model path).
        model_revision: :func:`model_revision_for`.
        dtype: K/V dtype name (``kvtier.types.dtype_name``).
        kv_layout: block layout name (:func:`kvtier.connectors.vllm.layout.layout_name`).
        block_size: tokens per block (vLLM's ``block_size``).
        tp_size: tensor-parallel world size.
        hash_name: ``"sha256"`` or ``"xxh3_128"``.
        kv_config: :func:`kv_config_for` (``KeyContext.kv_config``).
    """

    model_id: str
    model_revision: str
    dtype: str
    kv_layout: str
    block_size: int
    tp_size: int = 1
    hash_name: str = "sha256"
    kv_config: bytes = b""

    def context(
        self,
        tp_rank: int,
        lora_name: str | None = None,
        lora_version: str | None = None,
        cache_salt: str | None = None,
    ) -> KeyContext:
        """The :class:`KeyContext` of rank ``tp_rank``; with the request fields for a root."""
        return KeyContext(
            model_id=self.model_id,
            model_revision=self.model_revision,
            dtype=self.dtype,
            kv_layout=self.kv_layout,
            block_size=self.block_size,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            lora_name=lora_name,
            lora_version=lora_version,
            cache_salt=cache_salt,
            hash_name=self.hash_name,  # type: ignore[arg-type]
            kv_config=self.kv_config,
        )

    def namespace(self, tp_rank: int) -> bytes:
        """The store namespace of rank ``tp_rank`` (no request fields)."""
        return self.context(tp_rank).namespace()


def request_key_fields(request: Any) -> tuple[str | None, str | None, str | None]:
    """``(lora_name, lora_version, cache_salt)`` of a vLLM ``Request``. The LoRA version is
    its path (a retrained adapter under the same name must miss) and int id."""
    lora = getattr(request, "lora_request", None)
    lora_name = lora_version = None
    if lora is not None:
        lora_name = str(lora.lora_name)
        lora_version = f"{getattr(lora, 'lora_path', '')}#{getattr(lora, 'lora_int_id', '')}"
    salt = getattr(request, "cache_salt", None)
    return lora_name, lora_version, (str(salt) if salt is not None else None)


def request_media(request: Any) -> list[MediaItem] | None:
    """The media items of a vLLM ``Request`` (0.32: ``request.mm_features``, one
    ``MultiModalFeatureSpec`` per item: ``identifier``, ``modality``, ``mm_position.offset``
    and ``.length``), sorted; ``None`` when one cannot be keyed (no identifier, no position,
    overlapping or outside the prompt): such a request is not cached."""
    items = []
    for feature in getattr(request, "mm_features", None) or []:
        identifier, position = getattr(feature, "identifier", None), getattr(feature, "mm_position", None)
        if not identifier or position is None:
            return None
        key = f"{getattr(feature, 'modality', '')}:{identifier}".encode()
        try:
            items.append(MediaItem(int(position.offset), int(position.length), key))
        except (TypeError, ValueError):
            return None
    try:
        return check_items(items, len(request.all_token_ids) if items else 0)
    except ValueError:
        return None


@dataclass
class HashChain:
    """The block hashes and token fingerprints of one request on one TP rank, extended as
    its tokens grow.

    Attributes:
        root: the request's chain root (a namespace digest; also the fingerprints' root).
        block_size: tokens per block.
        hash_name: ``"sha256"`` or ``"xxh3_128"``.
        media: the request's media items (:func:`request_media`), keyed into their blocks.
        hashes: ``block_hash[0..n)`` computed so far.
        fingerprints: the blocks' token fingerprints, ``[n]``.
    """

    root: bytes
    block_size: int
    hash_name: str = "sha256"
    media: tuple[MediaItem, ...] = ()
    hashes: list[BlockHash] = field(default_factory=list)
    fingerprints: list[Fingerprint] = field(default_factory=list)

    def upto(self, token_ids: Sequence[int], num_blocks: int) -> list[BlockHash]:
        """Hashes of blocks ``0..num_blocks`` of ``token_ids`` (which must hold at least
        ``num_blocks * block_size`` tokens and start with the tokens hashed before).

        Raises:
            ValueError: ``token_ids`` is shorter than ``num_blocks`` full blocks.
        """
        return self.keys_upto(token_ids, num_blocks)[0]

    def keys_upto(self, token_ids: Sequence[int], num_blocks: int) -> tuple[list[BlockHash], list[Fingerprint]]:
        """Hashes and token fingerprints of blocks ``0..num_blocks`` (see :meth:`upto`)."""
        if num_blocks * self.block_size > len(token_ids):
            raise ValueError(f"expected >= {num_blocks * self.block_size} tokens, got {len(token_ids)}")
        bs, done = self.block_size, len(self.hashes)
        extras = block_extra_keys(self.media, num_blocks, bs, done) if self.media else [b""] * (num_blocks - done)
        for i, extra in zip(range(done, num_blocks), extras):
            parent, parent_fp = (self.hashes[-1], self.fingerprints[-1]) if self.hashes else (self.root, self.root)
            block_hash, fingerprint = key_block_tokens(
                parent, parent_fp, token_ids[i * bs : (i + 1) * bs], extra, self.hash_name
            )
            self.hashes.append(block_hash)
            self.fingerprints.append(fingerprint)
        return self.hashes[:num_blocks], self.fingerprints[:num_blocks]


def request_chains(engine_key: EngineKey, request: Any) -> list[HashChain]:
    """One :class:`HashChain` per TP rank for ``request`` (rank ``r`` at index ``r``), with
    its media items (none when it has none or they cannot be keyed: see :func:`request_media`)."""
    lora_name, lora_version, salt = request_key_fields(request)
    media = tuple(request_media(request) or ())
    return [
        HashChain(
            engine_key.context(rank, lora_name, lora_version, salt).namespace(),
            engine_key.block_size,
            engine_key.hash_name,
            media,
        )
        for rank in range(engine_key.tp_size)
    ]
