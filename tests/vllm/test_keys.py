"""Keys of the vLLM connector: per-request chains, namespaces, model fingerprints (no vLLM)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from kvtier.connectors.vllm.keys import (
    EngineKey,
    HashChain,
    kv_config_for,
    model_fingerprint,
    model_revision_for,
    request_chains,
    request_key_fields,
)
from kvtier.hashing import KeyContext, block_hashes_for

KEY = EngineKey("m", "rev", "float32", "vllm-cpu-attn/vec", block_size=4, tp_size=2)
TOKENS = list(range(100, 123))  # 5 full blocks of 4, 3 tokens over


def request(cache_salt=None, lora=None, lora_path="/a", lora_id=1):
    lora_request = SimpleNamespace(lora_name=lora, lora_path=lora_path, lora_int_id=lora_id) if lora else None
    return SimpleNamespace(request_id="r", all_token_ids=TOKENS, cache_salt=cache_salt, lora_request=lora_request)


def test_chain_matches_kvtier_hashing_and_grows_incrementally() -> None:
    root = KEY.context(0).namespace()
    chain = HashChain(root, 4)
    assert chain.upto(TOKENS, 2) == block_hashes_for(TOKENS[:8], root, 4)
    assert chain.upto(TOKENS, 5) == block_hashes_for(TOKENS, root, 4)
    assert chain.upto(TOKENS, 3) == block_hashes_for(TOKENS, root, 4)[:3]
    with pytest.raises(ValueError, match="expected >= 24 tokens"):
        chain.upto(TOKENS, 6)


def test_namespace_is_the_rank_key_context() -> None:
    expected = KeyContext(
        model_id="m", model_revision="rev", dtype="float32", kv_layout="vllm-cpu-attn/vec", block_size=4,
        tp_rank=1, tp_size=2,
    ).namespace()
    assert KEY.namespace(1) == expected
    assert KEY.namespace(0) != KEY.namespace(1)


def test_request_roots_separate_ranks_tenants_and_adapters() -> None:
    def hashes(req):
        return [chain.upto(TOKENS, 5) for chain in request_chains(KEY, req)]

    plain = hashes(request())
    assert len(plain) == 2 and plain[0] != plain[1]  # one chain per TP rank
    assert hashes(request()) == plain  # deterministic
    assert plain[0] == block_hashes_for(TOKENS, KEY.namespace(0), 4)  # no request fields: the rank namespace
    variants = [
        hashes(request(cache_salt="tenant-a")),
        hashes(request(cache_salt="tenant-b")),
        hashes(request(cache_salt="")),
        hashes(request(lora="x")),
        hashes(request(lora="x", lora_path="/b")),
        hashes(request(lora="x", lora_id=2)),
    ]
    firsts = [plain[0][0]] + [v[0][0] for v in variants]
    assert len(set(firsts)) == len(firsts)  # every block differs from the first one on


def test_request_key_fields() -> None:
    assert request_key_fields(request()) == (None, None, None)
    assert request_key_fields(request(cache_salt="s", lora="x")) == ("x", "/a#1", "s")


def test_model_fingerprint_follows_weights_and_config_only(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 10)
    (model / "tokenizer.json").write_text("{}")
    first = model_fingerprint(str(model))
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    (copy / "tokenizer.json").write_text('{"other": 1}')
    assert model_fingerprint(str(copy)) == first  # same content elsewhere, tokenizer ignored
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[1000] ^= 1
    (copy / "model.safetensors").write_bytes(bytes(weights))
    model_fingerprint.cache_clear()
    assert model_fingerprint(str(copy)) != first
    (model / "config.json").write_text('{"hidden_size": 8, "rope_theta": 1.0}')
    model_fingerprint.cache_clear()
    assert model_fingerprint(str(model)) != first
    with pytest.raises(FileNotFoundError):
        model_fingerprint(str(tmp_path / "missing"))


def test_model_revision_for(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert model_revision_for(SimpleNamespace(model=str(tmp_path)), override="v7") == "v7"
    assert model_revision_for(SimpleNamespace(model=str(tmp_path))) == model_fingerprint(str(tmp_path))
    missing = SimpleNamespace(model="no-such-org/no-such-model-kvtier", revision="abc")
    assert model_revision_for(missing) == "hub:abc"


def _vllm_config(hf_config, cache_dtype="auto", **model_fields):
    model_config = SimpleNamespace(hf_config=hf_config, disable_sliding_window=False, quantization=None)
    vars(model_config).update(model_fields)
    return SimpleNamespace(model_config=model_config, cache_config=SimpleNamespace(cache_dtype=cache_dtype))


def test_kv_config_enters_the_namespace_whatever_the_revision_says() -> None:
    transformers = pytest.importorskip("transformers")
    base = transformers.LlamaConfig(num_hidden_layers=2)
    scaled = transformers.LlamaConfig(num_hidden_layers=2, rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    configs = [
        _vllm_config(base), _vllm_config(scaled), _vllm_config(base, "fp8_e4m3"), _vllm_config(base, "fp8_e5m2"),
        _vllm_config(base, disable_sliding_window=True),
    ]
    keys = [EngineKey("m", "rev", "float32", "vllm-cpu-attn/vec", 4, kv_config=kv_config_for(c)) for c in configs]
    assert len({key.namespace(0) for key in keys}) == len(keys)
    assert kv_config_for(_vllm_config(transformers.LlamaConfig(num_hidden_layers=2))) == keys[0].kv_config
    # the request roots carry it too
    assert len({request_chains(key, request())[0].root for key in keys}) == len(keys)


def test_kv_config_is_read_after_hf_overrides(tmp_path) -> None:
    """vLLM applies ``hf_overrides`` (flat and nested) to ``model_config.hf_config``: a RoPE
    override under one revision string is another namespace."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    from tests.vllm.models import make_random_llama

    path = make_random_llama(tmp_path / "llama")

    def key(**overrides):
        model_config = ModelConfig(model=str(path), hf_overrides=overrides, max_model_len=256)
        vllm_config = SimpleNamespace(model_config=model_config, cache_config=SimpleNamespace(cache_dtype="auto"))
        return kv_config_for(vllm_config)

    plain = key()
    assert key() == plain
    assert key(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}) != plain
    assert key(max_position_embeddings=8192) != plain


def image(identifier, offset, length, modality="image"):
    return SimpleNamespace(identifier=identifier, modality=modality,
                           mm_position=SimpleNamespace(offset=offset, length=length))


def mm_request(*features, tokens=TOKENS):
    return SimpleNamespace(request_id="r", all_token_ids=tokens, cache_salt=None, lora_request=None,
                           mm_features=list(features))


def test_media_are_keyed_into_the_blocks_their_placeholders_fall_in() -> None:
    """Issue 11, item 3: the same token ids with another image are other blocks from the
    image's first block on; the blocks before it are shared."""
    def hashes(req):
        return request_chains(KEY, req)[0].upto(TOKENS, 5)

    plain, cat, dog = hashes(request()), hashes(mm_request(image("cat", 6, 5))), hashes(mm_request(image("dog", 6, 5)))
    assert plain[0] == cat[0] == dog[0]  # block 0 (tokens 0-3) holds no placeholder
    assert all(a != b for a, b in zip(cat[1:], dog[1:])) and all(a != b for a, b in zip(cat[1:], plain[1:]))
    assert hashes(mm_request(image("cat", 6, 5))) == cat  # the same image: the same blocks
    assert hashes(mm_request(image("cat", 7, 5)))[1] != cat[1]  # the same image elsewhere
    assert hashes(mm_request(image("cat", 6, 5, modality="audio")))[1] != cat[1]
    fps = [request_chains(KEY, mm_request(image(i, 6, 5)))[0].keys_upto(TOKENS, 5)[1] for i in ("cat", "dog")]
    assert fps[0][0] == fps[1][0] and fps[0][1] != fps[1][1]  # the fingerprints carry the image too


def test_media_that_cannot_be_keyed_make_the_request_uncacheable() -> None:
    from kvtier.connectors.vllm.keys import request_media

    assert request_media(request()) == []
    assert request_media(mm_request(image("b", 10, 2), image("a", 2, 3)))[0].start == 2  # sorted
    assert request_media(mm_request(image(None, 2, 3))) is None  # no identifier
    assert request_media(mm_request(image("a", 2, 3), image("b", 4, 3))) is None  # overlapping
    assert request_media(mm_request(image("a", 20, 8))) is None  # past the prompt
    assert request_media(mm_request(SimpleNamespace(identifier="a", modality="image", mm_position=None))) is None
