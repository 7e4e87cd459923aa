"""Media extra keys (kvtier.media; issue 11, item 3): per-block keys of the images whose
placeholder tokens fall in the block, and hits cut to whole images."""

from __future__ import annotations

import msgpack
import pytest
import torch

from kvtier.hashing import KeyContext, block_keys_for
from kvtier.media import MediaItem, block_extra_keys, check_items, content_hash, whole_items_prefix

B = 4
NS = KeyContext(model_id="m", block_size=B).namespace()


def test_content_hash_follows_pixels_dtype_and_shape():
    pixels = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0))
    same = pixels.clone()
    assert content_hash(pixels) == content_hash(same) == content_hash(pixels.numpy())
    other = pixels.clone()
    other[0, 0, 0] += 1e-3
    assert content_hash(other) != content_hash(pixels)
    assert content_hash(pixels.half()) != content_hash(pixels)
    assert content_hash(pixels.reshape(3, 64)) != content_hash(pixels)
    assert content_hash(b"png bytes") != content_hash(b"png bytez") and len(content_hash(b"x")) == 32
    with pytest.raises(TypeError):
        content_hash([1, 2, 3])


def test_block_keys_name_each_image_with_its_offset_in_the_block():
    a, b = MediaItem(2, 5, b"A" * 32), MediaItem(9, 2, b"B" * 32)  # tokens 2..6 and 9..10
    keys = block_extra_keys(check_items([b, a], 16), 4, B)
    decoded = [msgpack.unpackb(k) if k else [] for k in keys]
    assert decoded == [[[b"A" * 32, 2]], [[b"A" * 32, -2]], [[b"B" * 32, 1]], []]


def test_same_tokens_with_another_image_give_other_keys_from_the_image_on():
    tokens = list(range(100, 116))
    image = [MediaItem(5, 6, content_hash(b"cat"))]
    other = [MediaItem(5, 6, content_hash(b"dog"))]
    h_cat, f_cat = block_keys_for(tokens, NS, B, extra_keys=block_extra_keys(image, 4, B))
    h_dog, f_dog = block_keys_for(tokens, NS, B, extra_keys=block_extra_keys(other, 4, B))
    h_none, _ = block_keys_for(tokens, NS, B)
    assert h_cat[0] == h_dog[0] == h_none[0]  # before the image: shared
    assert all(x != y for x, y in zip(h_cat[1:], h_dog[1:]))  # the image's blocks and all after
    assert all(x != y for x, y in zip(f_cat[1:], f_dog[1:]))
    assert h_cat == block_keys_for(tokens, NS, B, extra_keys=block_extra_keys(image, 4, B))[0]
    moved = [MediaItem(6, 6, content_hash(b"cat"))]  # one image at another offset
    assert block_keys_for(tokens, NS, B, extra_keys=block_extra_keys(moved, 4, B))[0][1] != h_cat[1]


def test_whole_items_prefix_never_ends_inside_an_image():
    items = check_items([MediaItem(6, 5, b"x"), MediaItem(11, 2, b"y")], 40)  # 6..10, 11..12
    assert whole_items_prefix(items, 1, B) == 1  # ends at 4: before both
    assert whole_items_prefix(items, 2, B) == 1  # 8 is inside the first: back to 4
    assert whole_items_prefix(items, 3, B) == 1  # 12 inside the second, then 8 inside the first
    assert whole_items_prefix(items, 4, B) == 4  # 16: both wholly inside
    assert whole_items_prefix([], 3, B) == 3


def test_bad_items_raise():
    with pytest.raises(ValueError, match="overlap"):
        check_items([MediaItem(0, 4, b"a"), MediaItem(3, 2, b"b")], 10)
    with pytest.raises(ValueError, match="within"):
        check_items([MediaItem(8, 4, b"a")], 10)
    with pytest.raises(ValueError):
        MediaItem(0, 0, b"a")
    with pytest.raises(ValueError):
        MediaItem(0, 1, b"")
