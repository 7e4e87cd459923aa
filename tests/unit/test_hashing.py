"""Keys: chaining, namespaces, stability (cases K2, K4, B3)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashing import KeyContext, PrefixKeys, block_hashes_for, block_keys_for, hash_block_tokens

NS = KeyContext(model_id="m").namespace()


def test_chaining_changes_later_hashes_not_earlier():
    tokens = list(range(64))
    base = block_hashes_for(tokens, NS, 16)
    changed = list(tokens)
    changed[2 * 16 + 5] += 1  # a token in block 2
    other = block_hashes_for(changed, NS, 16)
    assert other[:2] == base[:2]
    assert all(a != b for a, b in zip(other[2:], base[2:]))


def test_same_block_in_another_position_hashes_differently():
    tokens = [7] * 32  # two identical blocks
    h0, h1 = block_hashes_for(tokens, NS, 16)
    assert h0 != h1


def test_partial_tail_is_not_keyed_regression_b3():
    assert len(block_hashes_for(list(range(3 * 16 + 5)), NS, 16)) == 3
    assert block_hashes_for(list(range(15)), NS, 16) == []


def test_hash_lengths_and_xxh3_option():
    (h,) = block_hashes_for(list(range(16)), NS, 16)
    (x,) = block_hashes_for(list(range(16)), NS, 16, hash_name="xxh3_128")
    assert len(h) == 32 and len(x) == 16


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="non-negative"):
        block_hashes_for([1, -2, 3, 4], NS, 2)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes_for([1, 2], NS, 0)
    with pytest.raises(ValueError, match="hash"):
        hash_block_tokens(NS, [1, 2], hash_name="md5")
    with pytest.raises(ValueError):
        KeyContext(model_id="")
    with pytest.raises(ValueError):
        KeyContext(model_id="m", tp_rank=1, tp_size=1)


_SCRIPT = (
    "from kvtier.hashing import KeyContext, block_keys_for;"
    "from kvtier.model_keys import kv_config_bytes, kv_config_fields;"
    "from transformers import Gemma3TextConfig;"
    "kv = kv_config_bytes(kv_config_fields(Gemma3TextConfig(), kv_cache_dtype='bfloat16'));"
    "ns = KeyContext(model_id='m', lora_name='a', cache_salt='s', kv_config=kv).namespace();"
    "hs, fps = block_keys_for(list(range(100)), ns, 16);"
    "print(ns.hex(), *[h.hex() for h in hs], *[f.hex() for f in fps])"
)


@pytest.mark.slow  # Python subprocesses
def test_hashes_stable_across_processes_and_hash_seeds_regression_k4():
    outputs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
        outputs.append(out.stdout.split())
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == 1 + 2 * (100 // 16)  # namespace, hashes, token fingerprints
    # and this process agrees with both
    from transformers import Gemma3TextConfig

    from kvtier.model_keys import kv_config_bytes, kv_config_fields

    kv = kv_config_bytes(kv_config_fields(Gemma3TextConfig(), kv_cache_dtype="bfloat16"))
    ns = KeyContext(model_id="m", lora_name="a", cache_salt="s", kv_config=kv).namespace()
    assert outputs[0][0] == ns.hex()


def test_lora_name_and_cache_salt_never_collide_regression_k2():
    lora = KeyContext(model_id="m", lora_name="x").namespace()
    salt = KeyContext(model_id="m", cache_salt="x").namespace()
    none = KeyContext(model_id="m").namespace()
    empty = KeyContext(model_id="m", cache_salt="").namespace()
    assert len({lora, salt, none, empty}) == 4


_text = st.one_of(st.none(), st.text(max_size=6))
_contexts = st.builds(
    KeyContext,
    model_id=st.text(min_size=1, max_size=6),
    model_revision=st.text(max_size=6),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    kv_layout=st.sampled_from(["LKVTHD", "other"]),
    block_size=st.sampled_from([1, 16, 32]),
    tp_rank=st.just(0),
    tp_size=st.integers(1, 4),
    lora_name=_text,
    lora_version=_text,
    cache_salt=_text,
    hash_name=st.sampled_from(["sha256", "xxh3_128"]),
    kv_config=st.one_of(st.just(b""), st.binary(max_size=6)),
)


@settings(max_examples=300, deadline=None)
@given(a=_contexts, b=_contexts)
def test_any_two_key_contexts_that_differ_give_different_first_block_hashes(a, b):
    tokens = list(range(32))
    ha = block_hashes_for(tokens, a.namespace(), a.block_size, a.hash_name)[0]
    hb = block_hashes_for(tokens, b.namespace(), b.block_size, b.hash_name)[0]
    assert (ha == hb) == (dataclasses.astuple(a) == dataclasses.astuple(b))


@pytest.mark.parametrize("hash_name", ["sha256", "xxh3_128"])
def test_block_keys_for_is_the_chain_of_key_block_tokens(hash_name):
    """block_keys_for encodes the tokens once and slices bytes: the same keys as chaining
    key_block_tokens block by block, with and without extra keys."""
    from kvtier.hashing import block_keys_for, key_block_tokens

    tokens = [(i * 7919) % (1 << 40) for i in range(70)]
    namespace = bytes(range(32))
    for extra in (None, [b"", b"img", b"", b"\x00\x01"]):
        got = block_keys_for(tokens, namespace, 16, hash_name, extra)
        parent, parent_fp, want = namespace, namespace, ([], [])
        for i in range(4):
            parent, parent_fp = key_block_tokens(parent, parent_fp, tokens[i * 16 : (i + 1) * 16],
                                                 extra[i] if extra else b"", hash_name)
            want[0].append(parent)
            want[1].append(parent_fp)
        assert got == want


def test_lazy_content_keys_are_the_content_keys_hashed_on_first_use():
    import numpy as np

    from kvtier.hashing import LazyContentKeys, content_keys

    tokens = list(range(100, 170))
    extra = [b"", b"img", b"", b""]
    lazy = LazyContentKeys(tokens, 16, extra)
    assert len(lazy) == 4 and lazy._keys is None  # the length needs no hashing
    assert list(lazy) == content_keys(tokens, 16, extra)
    assert lazy[1] == content_keys(tokens, 16, extra)[1] and lazy[-1] == content_keys(tokens, 16, extra)[-1]
    assert list(LazyContentKeys(np.asarray(tokens), 16)) == content_keys(tokens, 16)
    assert len(LazyContentKeys(tokens[:15], 16)) == 0 and list(LazyContentKeys(tokens[:15], 16)) == []


# -- PrefixKeys: the last list's keys reused for the blocks a new list shares (issue 17) ------
_NS = bytes(range(32))


@settings(max_examples=150, deadline=None)
@given(lists=st.lists(st.lists(st.integers(0, 3), max_size=70), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 4, 16]), hash_name=st.sampled_from(["sha256", "xxh3_128"]))
def test_prefix_keys_equal_block_keys_for_whatever_came_before(lists, block_size, hash_name):
    # small token alphabets: lists that share prefixes, differ inside a block, or at its edge
    keys = PrefixKeys(_NS, block_size, hash_name)
    for tokens in lists:
        assert keys(list(tokens)) == block_keys_for(tokens, _NS, block_size, hash_name)


def test_prefix_keys_hash_only_the_blocks_not_shared_with_the_last_list():
    keys = PrefixKeys(_NS, 4)
    turn1 = list(range(10))  # 2 whole blocks
    keys(turn1)
    assert keys.reused_blocks == 0
    turn2 = turn1 + [99, 98, 97, 96, 95]  # the conversation goes on: blocks 0-1 reused
    assert keys(turn2) == block_keys_for(turn2, _NS, 4)
    assert keys.reused_blocks == 2
    edited = turn2[:5] + [7] + turn2[6:]  # a token of block 1 differs: only block 0 is reused
    assert keys(edited) == block_keys_for(edited, _NS, 4)
    assert keys.reused_blocks == 3
    assert keys([1000] + edited) == block_keys_for([1000] + edited, _NS, 4)  # shifted: nothing shared
    assert keys.reused_blocks == 3


def test_prefix_keys_return_lists_the_caller_may_change():
    keys = PrefixKeys(_NS, 4)
    hashes, fingerprints = keys(list(range(8)))
    expected = block_keys_for(list(range(8)), _NS, 4)
    hashes.append(b"x"), fingerprints.clear()
    assert keys(list(range(12)))[0][:2] == expected[0] and keys.reused_blocks == 2


def test_prefix_keys_key_lists_with_extra_keys_in_full_and_forget_nothing():
    keys = PrefixKeys(_NS, 4)
    tokens = list(range(8))
    keys(tokens)
    extra = [b"image-a", b""]
    assert keys(tokens, extra) == block_keys_for(tokens, _NS, 4, extra_keys=extra)
    assert keys.reused_blocks == 0  # the image's blocks are not the plain list's
    assert keys(tokens) == block_keys_for(tokens, _NS, 4) and keys.reused_blocks == 2  # the plain list is still known


def test_prefix_keys_raise_as_block_keys_for_does():
    keys = PrefixKeys(_NS, 4)
    keys(list(range(8)))
    with pytest.raises(ValueError, match="non-negative"):
        keys(list(range(8)) + [-1])  # after shared blocks: the rest is checked
    with pytest.raises(ValueError, match="non-negative"):
        keys([-1] + list(range(8)))
    with pytest.raises(ValueError, match="block_size"):
        PrefixKeys(_NS, 0)
    assert keys(list(range(8))) == block_keys_for(list(range(8)), _NS, 4)  # still serving


def test_prefix_keys_remember_a_copy_of_the_callers_list():
    # a caller that edits its list in place and passes it again (found in review, 2026-12-03):
    # the memo compared the list with itself and reused every block
    keys = PrefixKeys(_NS, 4)
    tokens = list(range(16))
    keys(tokens)
    tokens[1] = 99
    assert keys(tokens) == block_keys_for(tokens, _NS, 4) and keys.reused_blocks == 0
    del tokens[8:]
    tokens += [5, 5, 5, 5, 5, 5, 5, 5]
    assert keys(tokens) == block_keys_for(tokens, _NS, 4) and keys.reused_blocks == 2


def test_prefix_keys_key_arrays_and_tensors_in_full_and_keep_the_list_memo():
    import numpy as np
    import torch

    keys = PrefixKeys(_NS, 4)
    tokens = list(range(12))
    keys(tokens)
    for seq in (np.asarray(tokens), torch.tensor(tokens), tuple(tokens)):
        assert keys(seq) == block_keys_for(tokens, _NS, 4)
        assert keys(seq) == block_keys_for(tokens, _NS, 4)  # twice: nothing of it was remembered
    assert keys.reused_blocks == 0
    assert keys(tokens + [1, 2, 3, 4]) == block_keys_for(tokens + [1, 2, 3, 4], _NS, 4) and keys.reused_blocks == 3
