"""Block keys: a namespace from a typed key context, and block hashes chained over a prompt.

``block_hash[i] = H(DOMAIN, block_hash[i-1], token_ids of block i, extra_keys of block i)``
with ``block_hash[-1] = namespace``. Only full blocks are keyed: a partial tail block is always
recomputed. The byte encoding is canonical (fixed-width little-endian token ids, msgpack for
the key context with every field tagged by name), never ``pickle`` or Python's ``hash()``, so
keys are the same in every process and after restarts (vLLM CVE-2025-25183, LMCache issue 1739:
seeded or pickled hashes either change across processes or can be made to collide).

H is SHA-256 (32-byte hashes) by default; ``xxh3_128`` (16 bytes, from the ``xxhash``
package) is an option for when hashing shows in profiles and collision resistance against a
hostile tenant is not needed (isolate such tenants with ``cache_salt``).

Beside its hash, every block has a *fingerprint* of the tokens it covers, always SHA-256
under its own domain and chained over the fingerprints, never over the block hashes::

    fingerprint[i] = SHA-256(TOKENS_DOMAIN, fingerprint[i-1], token_ids of block i, extra_keys)

with ``fingerprint[-1] = namespace``. Every tier stores it with the block and a load checks
it against the request's (:mod:`kvtier.records`, :mod:`kvtier.store`): a hash decides where
to look, never alone what is served. A collision of the block hash (xxh3-128 against an
adversary, or a bug that stores a block under another key) then serves nothing: the stored
fingerprint differs. Chaining over fingerprints rather than over the (possibly weak) parent
hash makes the fingerprint bind the whole prefix, so a block computed after another prompt's
colliding parent is caught too, not only the colliding block itself.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Literal, Sequence

import msgpack
import numpy as np

from kvtier.types import KV_LAYOUT, BlockHash, Fingerprint

HashName = Literal["sha256", "xxh3_128"]
HASH_NAMES: tuple[str, ...] = ("sha256", "xxh3_128")

_NAMESPACE_DOMAIN = b"kvtier/namespace/v1"
_BLOCK_DOMAIN = b"kvtier/block/v1"
_TOKENS_DOMAIN = b"kvtier/tokens/v1"


def _digest(hash_name: str, data: bytes) -> bytes:
    if hash_name == "sha256":
        return hashlib.sha256(data).digest()
    if hash_name == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128_digest(data)
    raise ValueError(f"expected hash in {HASH_NAMES}, got {hash_name!r}")


@dataclass(frozen=True)
class KeyContext:
    """Everything that changes the bytes of K/V, and nothing else (case K3: pool sizes,
    thread counts and other tuning knobs must not be in a key, or a restart misses).

    Attributes:
        model_id: model name or path as the user gave it, e.g. ``HuggingFaceTB/SmolLM2-135M``.
        model_revision: weights digest or revision; two checkpoints of one model differ here.
        dtype: canonical K/V dtype name (``kvtier.types.dtype_name``).
        kv_layout: block layout name (``KVSpec.layout_name``: ``kvtier.types.KV_LAYOUT`` for
            full attention, the layer groups otherwise).
        block_size: tokens per block.
        tp_rank, tp_size: tensor-parallel rank and world size (each rank keeps its heads).
        lora_name, lora_version: LoRA adapter applied, if any.
        cache_salt: tenant isolation salt (vLLM's ``cache_salt``): tenants never share blocks.
        hash_name: block hash function; part of the namespace so two choices never mix.
        kv_config: canonical bytes of the K/V-relevant fields of the effective model config
            (:func:`kvtier.model_keys.kv_config_bytes`): RoPE, windows, heads, attention
            scaling, KV dtype, ... Set by the connectors whatever ``model_revision`` says, so
            a config change under one revision string misses (``b""``: not given).
    """

    model_id: str
    model_revision: str = ""
    dtype: str = "float32"
    kv_layout: str = KV_LAYOUT
    block_size: int = 16
    tp_rank: int = 0
    tp_size: int = 1
    lora_name: str | None = None
    lora_version: str | None = None
    cache_salt: str | None = None
    hash_name: HashName = "sha256"
    kv_config: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"expected a non-empty model_id string, got {self.model_id!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"expected block_size > 0, got {self.block_size!r}")
        if not (0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"expected 0 <= tp_rank < tp_size, got {self.tp_rank}, {self.tp_size}")
        if self.hash_name not in HASH_NAMES:
            raise ValueError(f"expected hash_name in {HASH_NAMES}, got {self.hash_name!r}")
        for f in ("model_revision", "dtype", "kv_layout", "lora_name", "lora_version", "cache_salt"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"expected {f} to be a str or None, got {type(v).__name__}")
        if not isinstance(self.kv_config, bytes):
            raise ValueError(f"expected kv_config to be bytes (kv_config_bytes), got {type(self.kv_config).__name__}")

    def canonical_bytes(self) -> bytes:
        """Canonical encoding: msgpack of ``[[field_name, value], ...]`` in declaration order.

        Tagging each value with its field name means ``lora_name="x"`` and ``cache_salt="x"``
        can never encode alike (case K2), and ``None`` stays distinct from ``""``.
        """
        values = asdict(self)
        return msgpack.packb([[f.name, values[f.name]] for f in fields(self)], use_bin_type=True)

    def namespace(self) -> bytes:
        """32-byte SHA-256 digest of the key context: the root of every block hash chain.
        The context is remembered (:func:`known_context`) so that a miss can say which field
        differs from another namespace that stored the same tokens."""
        namespace = hashlib.sha256(_NAMESPACE_DOMAIN + self.canonical_bytes()).digest()
        _remember_context(namespace, self)
        return namespace


def _block_body(token_ids: Sequence[int] | np.ndarray, extra_keys: bytes) -> bytes:
    """``len u32 | token ids int64-LE | len u32 | extra_keys``: what both the block hash and
    the fingerprint cover after their parent."""
    tokens = np.ascontiguousarray(token_ids, dtype="<i8")
    return (
        len(tokens).to_bytes(4, "little") + tokens.tobytes() + len(extra_keys).to_bytes(4, "little") + extra_keys
    )


def hash_block_tokens(
    parent: bytes,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: bytes = b"",
    hash_name: str = "sha256",
) -> BlockHash:
    """Hash one full block of ``token_ids`` chained to ``parent``.

    Args:
        parent: previous block's hash, or the namespace for the first block.
        token_ids: the block's token ids (``block_size`` ints, each in [0, 2**63)).
        extra_keys: canonical bytes of anything else that changes this block's K/V
            (e.g. an image hash for multimodal tokens); empty when none.
        hash_name: ``"sha256"`` or ``"xxh3_128"``.
    """
    header = len(parent).to_bytes(1, "little") + parent
    return BlockHash(_digest(hash_name, _BLOCK_DOMAIN + header + _block_body(token_ids, extra_keys)))


def fingerprint_block_tokens(
    parent: bytes, token_ids: Sequence[int] | np.ndarray, extra_keys: bytes = b""
) -> Fingerprint:
    """The 32-byte fingerprint of one block (module docstring): SHA-256 whatever the block
    hash function, chained to ``parent`` (the previous block's fingerprint, or the namespace
    for the first block)."""
    return Fingerprint(hashlib.sha256(_TOKENS_DOMAIN + parent + _block_body(token_ids, extra_keys)).digest())


def key_block_tokens(
    parent: bytes, parent_fingerprint: bytes, token_ids: Sequence[int] | np.ndarray, extra_keys: bytes = b"",
    hash_name: str = "sha256",
) -> tuple[BlockHash, Fingerprint]:
    """``(hash_block_tokens(parent, ...), fingerprint_block_tokens(parent_fingerprint, ...))``
    encoding the tokens once: the next link of both chains."""
    body = _block_body(token_ids, extra_keys)
    block_hash = BlockHash(_digest(hash_name, _BLOCK_DOMAIN + len(parent).to_bytes(1, "little") + parent + body))
    return block_hash, Fingerprint(hashlib.sha256(_TOKENS_DOMAIN + parent_fingerprint + body).digest())


def block_hashes_for(
    token_ids: Sequence[int] | np.ndarray,
    namespace: bytes,
    block_size: int,
    hash_name: str = "sha256",
    extra_keys: Sequence[bytes] | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``; the partial tail gets none.

    Args:
        token_ids: the prompt (or prompt + output) token ids, ``[num_tokens]`` ints.
        namespace: ``KeyContext.namespace()``.
        block_size: tokens per block.
        hash_name: ``"sha256"`` or ``"xxh3_128"``.
        extra_keys: optional per-block extra key bytes, one entry per full block.

    Returns:
        ``num_tokens // block_size`` hashes, in prompt order.

    Raises:
        ValueError: negative token ids, a bad ``block_size`` or ``extra_keys`` length.
    """
    tokens, num_blocks = _full_blocks(token_ids, block_size, extra_keys)
    hashes: list[BlockHash] = []
    parent = namespace
    for i in range(num_blocks):
        extra = extra_keys[i] if extra_keys is not None else b""
        parent = hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra, hash_name)
        hashes.append(parent)
    return hashes


def _full_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, extra_keys: Sequence[bytes] | None
) -> tuple[np.ndarray, int]:
    """``token_ids`` as int64 and the number of full blocks, checked (the errors of
    :func:`block_hashes_for`)."""
    if block_size <= 0:
        raise ValueError(f"expected block_size > 0, got {block_size}")
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if tokens.size and int(tokens.min()) < 0:
        raise ValueError(f"expected non-negative token ids, got min {int(tokens.min())}")
    num_blocks = tokens.size // block_size
    if extra_keys is not None and len(extra_keys) != num_blocks:
        raise ValueError(f"expected {num_blocks} extra_keys entries, got {len(extra_keys)}")
    return tokens, num_blocks


def block_keys_for(
    token_ids: Sequence[int] | np.ndarray,
    namespace: bytes,
    block_size: int,
    hash_name: str = "sha256",
    extra_keys: Sequence[bytes] | None = None,
) -> tuple[list[BlockHash], list[Fingerprint]]:
    """The block hashes (:func:`block_hashes_for`) and fingerprints of every full block of
    ``token_ids``, in one pass over the tokens: what a connector hands the store on a load
    (expected) and on a store (kept with each block). Same arguments and errors as
    :func:`block_hashes_for`."""
    tokens, num_blocks = _full_blocks(token_ids, block_size, extra_keys)
    return _chain_keys(tokens[: num_blocks * block_size], block_size, namespace, namespace, hash_name, extra_keys)


def _chain_keys(
    tokens: np.ndarray, block_size: int, parent: bytes, parent_fp: bytes, hash_name: str,
    extra_keys: Sequence[bytes] | None = None,
) -> tuple[list[BlockHash], list[Fingerprint]]:
    """The keys of the whole blocks of ``tokens`` (int64, checked, a multiple of
    ``block_size`` long), chained on from ``parent`` and ``parent_fp`` (the block before
    them, or the namespace twice)."""
    hashes: list[BlockHash] = []
    fingerprints: list[Fingerprint] = []
    # key_block_tokens block by block, the tokens encoded once (int64-LE) and sliced as bytes:
    # the same bytes hashed, without a numpy slice and conversion per block
    raw = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    step, count, no_extra = block_size * 8, block_size.to_bytes(4, "little"), (0).to_bytes(4, "little")
    # (no BlockHash()/Fingerprint() wrappers per block: NewType's call is a Python call each)
    sha256 = hashlib.sha256
    for i in range(len(tokens) // block_size):
        extra = extra_keys[i] if extra_keys else b""
        body = count + raw[i * step : (i + 1) * step] + (len(extra).to_bytes(4, "little") + extra if extra else no_extra)
        parent = _digest(hash_name, _BLOCK_DOMAIN + len(parent).to_bytes(1, "little") + parent + body)
        parent_fp = sha256(_TOKENS_DOMAIN + parent_fp + body).digest()
        hashes.append(parent)
        fingerprints.append(parent_fp)
    return hashes, fingerprints


class PrefixKeys:
    """:func:`block_keys_for` of one namespace that reuses the keys of the last token list
    it keyed for the whole blocks a new list shares with it, hashing only the rest.

    A multi-turn chat's prompt is the last turn's prompt and output plus a new message, and
    a connector keys each of them twice (``before_prefill``, ``after_request``): without
    this, every call hashed the whole conversation again (0.3 ms of a 1k-token hit's ~1 ms
    before its first DISK read, 4.7 us a block; issue 17, bench/results/2026-12-03-hit-overhead).
    vLLM keeps the block hashes on its request and hashes only the blocks each step fills
    (``Request.block_hashes``); a connector called with bare token lists finds the shared
    blocks by comparing tokens. Exact: a block's keys are reused only when every token up
    to its end equals the last list's; lists with per-block extra keys (images), and token
    sequences other than a plain ``list`` (tuples, arrays, tensors), are keyed in full and
    not remembered. One list is remembered, as a copy (a caller may change its list
    afterwards), with two 32-byte keys a block; not thread-safe beyond that each call sees
    one whole memo.
    """

    def __init__(self, namespace: bytes, block_size: int, hash_name: str = "sha256") -> None:
        if block_size <= 0:
            raise ValueError(f"expected block_size > 0, got {block_size}")
        self.namespace, self.block_size, self.hash_name = namespace, block_size, hash_name
        self._last: tuple[list[int], list[BlockHash], list[Fingerprint]] | None = None  # tokens, keys
        self.reused_blocks = 0  # blocks whose keys came from the memo (for tests and traces)

    def __call__(
        self, tokens: list[int], extra_keys: Sequence[bytes] | None = None,
    ) -> tuple[list[BlockHash], list[Fingerprint]]:
        """``block_keys_for(tokens, namespace, block_size, hash_name, extra_keys)``.
        Raises ``ValueError`` as :func:`block_keys_for` does."""
        if extra_keys is not None or type(tokens) is not list:
            return block_keys_for(tokens, self.namespace, self.block_size, self.hash_name, extra_keys)
        bs = self.block_size
        last_tokens, last_hashes, last_fps = self._last or ([], [], [])
        shared = _shared_blocks(tokens, last_tokens, min(len(tokens) // bs, len(last_hashes)), bs)
        parent, parent_fp = (last_hashes[shared - 1], last_fps[shared - 1]) if shared else (self.namespace, self.namespace)
        rest, num_blocks = _full_blocks(tokens[shared * bs :], bs, None)
        more_hashes, more_fps = _chain_keys(rest[: num_blocks * bs], bs, parent, parent_fp, self.hash_name)
        hashes, fps = last_hashes[:shared] + more_hashes, last_fps[:shared] + more_fps
        self.reused_blocks += shared
        self._last = (tokens[: len(hashes) * bs], hashes, fps)  # a copy of the keyed blocks' tokens
        return list(hashes), list(fps)


def _shared_blocks(a: list[int], b: list[int], most: int, block_size: int) -> int:
    """Leading whole blocks of ``block_size`` tokens equal in ``a`` and ``b`` (at most ``most``)."""
    n = most * block_size
    if a[:n] == b[:n]:  # the usual case (the last list is this one's prefix): one comparison in C
        return most
    for i in range(most):
        if a[i * block_size : (i + 1) * block_size] != b[i * block_size : (i + 1) * block_size]:
            return i
    return most


# -- what explains a miss: content keys and the contexts seen in this process -----------------
_CONTENT_DOMAIN = b"kvtier/content/v1"
KNOWN_CONTEXTS = 256
"""Key contexts remembered per process (namespace -> context), most recent last."""
_contexts: dict[bytes, KeyContext] = {}


def _remember_context(namespace: bytes, context: KeyContext) -> None:
    if _contexts.get(namespace) is context:
        return
    _contexts.pop(namespace, None)
    _contexts[namespace] = context
    while len(_contexts) > KNOWN_CONTEXTS:
        del _contexts[next(iter(_contexts))]


def known_context(namespace: bytes) -> KeyContext | None:
    """The key context whose ``namespace()`` this process computed recently, if any."""
    return _contexts.get(namespace)


def context_difference(a: KeyContext, b: KeyContext) -> dict[str, tuple[object, object]]:
    """Fields whose values differ between two key contexts: ``{name: (a's, b's)}``."""
    va, vb = asdict(a), asdict(b)
    return {f.name: (va[f.name], vb[f.name]) for f in fields(a) if va[f.name] != vb[f.name]}


def content_keys(
    token_ids: Sequence[int] | np.ndarray, block_size: int, extra_keys: Sequence[bytes] | None = None
) -> list[bytes]:
    """Namespace-free chained digests of every full block of ``token_ids`` (8-byte xxh3-64):
    the same tokens give the same keys under every model, dtype, LoRA or salt, so a miss can
    tell "stored under another namespace" from "never stored". Never a cache key (64 bits,
    no namespace): only an index for explanations.

    Args:
        token_ids: ``[num_tokens]`` ints; the partial tail gets no key.
        block_size: tokens per block.
        extra_keys: per-block extra key bytes, as given to :func:`block_hashes_for`.
    """
    import xxhash

    tokens = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64).reshape(-1), dtype="<i8")
    num_blocks = tokens.size // block_size
    keys: list[bytes] = []
    parent = _CONTENT_DOMAIN
    for i in range(num_blocks):
        extra = extra_keys[i] if extra_keys is not None else b""
        parent = xxhash.xxh3_64_digest(parent + tokens[i * block_size : (i + 1) * block_size].tobytes() + extra)
        keys.append(parent)
    return keys


class LazyContentKeys(Sequence[bytes]):
    """:func:`content_keys` of a prompt, computed on first use: a hit that misses nothing
    (no block after its prefix needs a reason) never hashes them. A sequence of 8-byte keys,
    one per full block (``len`` is known without hashing).

    Args:
        token_ids: ``[num_tokens]`` ints (kept as given: do not change them afterwards).
        block_size: tokens per block (> 0).
        extra_keys: per-block extra key bytes, as for :func:`content_keys`.
    """

    __slots__ = ("_tokens", "_block_size", "_extra", "_keys")

    def __init__(
        self, token_ids: Sequence[int] | np.ndarray, block_size: int, extra_keys: Sequence[bytes] | None = None
    ) -> None:
        self._tokens, self._block_size, self._extra = token_ids, block_size, extra_keys
        self._keys: list[bytes] | None = None

    def _computed(self) -> list[bytes]:
        if self._keys is None:
            self._keys = content_keys(self._tokens, self._block_size, self._extra)
        return self._keys

    def __len__(self) -> int:
        return len(self._tokens) // self._block_size

    def __getitem__(self, index):  # type: ignore[override]
        return self._computed()[index]

    def __iter__(self):
        return iter(self._computed())
