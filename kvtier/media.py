"""Media in prompts: the extra keys of the blocks an image's placeholder tokens fall in.

A multimodal prompt holds, for each media item (an image), a run of placeholder tokens whose
embeddings come from the item, not from the token ids: the same token ids with another image
are other K/V. So every block that holds placeholder tokens of an item gets, as extra keys
(``kvtier.hashing``: part of its hash and of its token fingerprint), the item's content hash
and its offset relative to the block's first token (vLLM's ``_gen_mm_extra_hash_keys``: the
offset keeps one image at two positions apart). Blocks after an image need no key of it: the
chain carries it.

A :class:`MediaItem` is where an item's placeholders are and what it is: its content hash is
a digest of its pixels (:func:`content_hash`, as vLLM's ``mm_hash`` is of the item's data), or
an engine's own item identifier. A request whose media cannot be told apart this way is not
cached (the connectors check).

Engines that embed an item only when its whole placeholder run is prefilled in one pass
(transformers' VLMs) may not start a prefill in the middle of an item:
:func:`whole_items_prefix` cuts a hit back to a block boundary that no item straddles.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack

_CONTENT_DOMAIN = b"kvtier/media/v1"


@dataclass(frozen=True)
class MediaItem:
    """One media item of a prompt.

    Attributes:
        start: position of its first placeholder token in the prompt.
        length: its placeholder tokens (> 0), ``start .. start + length - 1``.
        content_hash: digest of its content (:func:`content_hash`, or an engine's item hash),
            non-empty bytes.
    """

    start: int
    length: int
    content_hash: bytes

    def __post_init__(self) -> None:
        for name in ("start", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "length" else 0):
                raise ValueError(f"expected {name} to be an int >= {1 if name == 'length' else 0}, got {value!r}")
        if not isinstance(self.content_hash, bytes) or not self.content_hash:
            raise ValueError(f"expected content_hash as non-empty bytes, got {type(self.content_hash).__name__}")

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.start + self.length


def content_hash(data: Any) -> bytes:
    """SHA-256 of a media item's content under kvtier's media domain: a tensor or array (its
    dtype, shape and bytes: the pixel values a processor made), or raw ``bytes`` (an
    encoded file).

    Raises:
        TypeError: another kind of value.
    """
    digest = hashlib.sha256(_CONTENT_DOMAIN)
    if isinstance(data, (bytes, bytearray, memoryview)):
        digest.update(b"bytes|")
        digest.update(data)
        return digest.digest()
    if hasattr(data, "detach"):  # a torch tensor
        data = data.detach().to("cpu").contiguous()
        digest.update(f"{str(data.dtype).removeprefix('torch.')}|{tuple(data.shape)}|".encode())
        import torch

        digest.update(data.reshape(-1).view(torch.uint8).numpy())
        return digest.digest()
    if hasattr(data, "tobytes") and hasattr(data, "dtype"):  # a numpy array
        digest.update(f"{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.tobytes())
        return digest.digest()
    raise TypeError(f"expected a tensor, an array or bytes, got {type(data).__name__}")


def check_items(items: Sequence[MediaItem], num_tokens: int) -> list[MediaItem]:
    """``items`` sorted by position; raises ``ValueError`` if two overlap or one ends past
    ``num_tokens``."""
    ordered = sorted(items, key=lambda item: item.start)
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.end:
            raise ValueError(f"expected media items not to overlap, got [{a.start}, {a.end}) and [{b.start}, {b.end})")
    if ordered and ordered[-1].end > num_tokens:
        raise ValueError(
            f"expected media items within the {num_tokens} prompt tokens, got one ending at {ordered[-1].end}"
        )
    return ordered


def block_extra_keys(
    items: Sequence[MediaItem], num_blocks: int, block_size: int, first_block: int = 0
) -> list[bytes]:
    """The extra keys of blocks ``first_block .. num_blocks - 1``: for each block, msgpack of
    ``[[content_hash, start - block_start], ...]`` over the items whose placeholders fall in
    it (``b""`` for a block with none). ``items``: sorted, not overlapping (:func:`check_items`)."""
    keys: list[bytes] = []
    first = 0
    for i in range(first_block, num_blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        while first < len(items) and items[first].end <= lo:
            first += 1
        inside = []
        for item in items[first:]:
            if item.start >= hi:
                break
            inside.append([item.content_hash, item.start - lo])
        keys.append(msgpack.packb(inside, use_bin_type=True) if inside else b"")
    return keys


def whole_items_prefix(items: Sequence[MediaItem], num_blocks: int, block_size: int) -> int:
    """The largest ``n <= num_blocks`` whose first ``n * block_size`` tokens end outside every
    item (each item wholly in them or wholly after them). ``items``: sorted (:func:`check_items`)."""
    n = num_blocks
    for item in reversed(items):
        if item.start < n * block_size < item.end:
            n = item.start // block_size
    return n
