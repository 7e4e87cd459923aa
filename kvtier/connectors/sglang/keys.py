"""Keys: SGLang's page keys mapped into a kvtier namespace.

SGLang keys every L3 page by a SHA-256 hex string chained over the page's token ids and the
previous page's key (``sglang.srt.mem_cache.utils.get_hash_str``; the chain is seeded with
the request's ``extra_key``/``cache_salt`` when it has them). The key depends on tokens only:
not on the model, its weights, the dtype, the TP rank or the page layout. kvtier therefore
roots each backend in a namespace of everything that changes a page's bytes
(:func:`namespace_context`) and stores page ``key`` under::

    block_hash = SHA-256(b"kvtier/sglang-page/v1" || namespace || utf8(key))

so two models, two ranks or two tenants (``cache_salt``) never read each other's pages, also
on a shared REMOTE tier, while every engine with the same namespace (a restart, a replica)
hits the same blocks. The page's token fingerprint (kvtier's verified hits: what every tier
keeps with the block and a load checks) is, since SGLang hands kvtier keys rather than
tokens, a digest of the key under its own domain: SGLang's key is a SHA-256 over the page's
tokens and its prefix, so a page is served only to a request of the same key, whatever the
block hash did (:func:`block_keys`). MLA pages are identical on every TP rank (SGLang writes them from one
rank), so an MLA namespace has no TP rank or size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from kvtier.connectors.sglang.layout import PageLayout
from kvtier.hashing import KeyContext
from kvtier.types import BlockHash, Fingerprint, dtype_name

_DOMAIN = b"kvtier/sglang-page/v1"
_FINGERPRINT_DOMAIN = b"kvtier/sglang-page-tokens/v1"
MAX_KEY_CHARS = 1024
"""Longest page key accepted (SGLang's are 64 hex characters, plus a pool suffix for v2)."""


def namespace_context(
    storage_config: Any, layout: PageLayout, model_id: str, model_revision: str = "", cache_salt: str | None = None
) -> KeyContext:
    """The key context of one backend.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (TP/PP/CP ranks, the MLA flag).
        layout: the registered host pool's page layout.
        model_id: served model name (or the ``model_id`` option).
        model_revision: weights identity, when given.
        cache_salt: tenant salt, when given.

    Raises:
        ValueError: an empty ``model_id`` or inconsistent ranks.
    """
    c = storage_config
    pp = f"pp{c.pp_rank}of{c.pp_size}" if c.pp_size > 1 else "pp1"
    cp = f"cp{c.attn_cp_rank}of{c.attn_cp_size}" if c.attn_cp_size > 1 else "cp1"
    mla = layout.kind == "MLA"
    return KeyContext(
        model_id=model_id,
        model_revision=model_revision,
        dtype=dtype_name(layout.dtype),
        kv_layout=f"{layout.name}/{pp}/{cp}",
        block_size=layout.page_size,
        tp_rank=0 if mla else c.tp_rank,
        tp_size=1 if mla else c.tp_size,
        cache_salt=cache_salt,
    )


def block_hashes(namespace: bytes, keys: Sequence[str]) -> list[BlockHash]:
    """kvtier block hashes of SGLang page keys, in order.

    Raises:
        ValueError: a key that is not a non-empty string of at most ``MAX_KEY_CHARS``.
    """
    return block_keys(namespace, keys)[0]


def block_keys(namespace: bytes, keys: Sequence[str]) -> tuple[list[BlockHash], list[Fingerprint]]:
    """kvtier block hashes and token fingerprints of SGLang page keys, in order (module
    docstring).

    Raises:
        ValueError: a key that is not a non-empty string of at most ``MAX_KEY_CHARS``.
    """
    hashes: list[BlockHash] = []
    fingerprints: list[Fingerprint] = []
    for key in keys:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            got = f"str of length {len(key)}" if isinstance(key, str) else type(key).__name__
            raise ValueError(f"expected SGLang page keys as strings of 1..{MAX_KEY_CHARS} characters, got {got}")
        encoded = namespace + key.encode("utf-8")
        hashes.append(BlockHash(hashlib.sha256(_DOMAIN + encoded).digest()))
        fingerprints.append(Fingerprint(hashlib.sha256(_FINGERPRINT_DOMAIN + encoded).digest()))
    return hashes, fingerprints
