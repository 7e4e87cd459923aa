"""HF connector with images (issue 11, item 3) on a tiny random-weight LLaVA (CLIP vision
tower, Llama text model; both in transformers 5.17 and 5.24): blocks holding an image's
placeholder tokens are keyed by the image, a hit never ends inside an image, and the
output equals a run without kvtier."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier.config import StoreConfig  # noqa: E402
from kvtier.connectors.hf import HFConnector  # noqa: E402
from kvtier.connectors.hf_media import prompt_media  # noqa: E402

BLOCK = 8
IMAGE_TOKEN, IMAGE_TOKENS = 299, 16  # a 32x32 image in 8x8 patches: 16 placeholder tokens


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    text = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
    )
    vision = transformers.CLIPVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, projection_dim=32, initializer_range=0.3,
    )
    config = transformers.LlavaConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=IMAGE_TOKEN,
        image_seq_length=IMAGE_TOKENS, vision_feature_layer=-1,
    )
    return transformers.LlavaForConditionalGeneration(config).eval()


@pytest.fixture
def connector(llava, tmp_path):
    config = StoreConfig(gpu_bytes=0, cpu_bytes=8 << 20, disk_bytes=64 << 20, block_size=BLOCK, data_dir=tmp_path)
    conn = HFConnector.from_model(llava, config, model_id="tiny-llava", model_revision="r1")
    yield conn
    conn.close()


def image(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def prompt(before: int, after: int, seed: int = 0) -> torch.Tensor:
    """``before`` text tokens, one image's placeholder run, ``after`` text tokens."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, IMAGE_TOKEN, (before + after,), generator=g).tolist()
    return torch.tensor([text[:before] + [IMAGE_TOKEN] * IMAGE_TOKENS + text[before:]])


def greedy(model, ids, pixels, connector=None, max_new_tokens=6):
    inputs = {"input_ids": ids, "pixel_values": pixels}
    if connector is None:
        with torch.inference_mode():
            out = model.generate(ids, pixel_values=pixels, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist(), None
    plan = connector.before_prefill(ids, media=inputs)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             **plan.generate_kwargs())
    connector.after_request(out[0], plan.cache, media=inputs)
    return out[0, ids.shape[1]:].tolist(), plan


@pytest.mark.slow  # generate runs of a tiny LLaVA; the other-image miss is the fast lane's
def test_the_same_image_hits_and_output_equals_cold(llava, connector):
    ids, pixels = prompt(5, 30), image(1)
    first, plan = greedy(llava, ids, pixels, connector)
    assert plan.num_cached_tokens == 0 and first == greedy(llava, ids, pixels)[0]
    again, plan = greedy(llava, ids, pixels, connector)
    assert plan.num_cached_tokens == 48  # (51 - 1) // 8 blocks: the image wholly inside
    assert "pixel_values" not in plan.generate_kwargs()  # embedded already: not again
    assert again == first


def test_the_same_token_ids_with_another_image_miss_from_the_image_on(llava, connector):
    ids = prompt(10, 30, seed=2)  # the image's tokens are 10..25: blocks 1..3
    greedy(llava, ids, image(1), connector)
    other, plan = greedy(llava, ids, image(2), connector)
    assert plan.num_cached_tokens == 8  # block 0, before the image, only
    assert torch.equal(plan.generate_kwargs()["pixel_values"], image(2))
    assert other == greedy(llava, ids, image(2))[0]
    assert other != greedy(llava, ids, image(1))[0]  # the image matters to the output


@pytest.mark.slow  # generate runs of a tiny LLaVA; the other-image miss is the fast lane's
def test_a_hit_never_ends_inside_an_image(llava, connector):
    """transformers embeds an image only in the prefill that holds its whole placeholder
    run: a cached prefix ending inside the run would leave the rest of the image unembedded
    (or make the model refuse the features). The hit is cut before the image."""
    ids, pixels = prompt(10, 20, seed=3), image(3)  # image tokens 10..25: blocks 1, 2 and 3
    greedy(llava, ids, pixels, connector)
    other = ids.clone()
    other[0, 28:] = (other[0, 28:] + 1) % IMAGE_TOKEN  # the same up to token 27: blocks 0..2 hit
    warm, plan = greedy(llava, other, pixels, connector)
    assert plan.num_cached_tokens == 8  # blocks 1..2 end inside the image: cut before it
    assert torch.equal(plan.generate_kwargs()["pixel_values"], pixels)
    assert warm == greedy(llava, other, pixels)[0]
    assert sum(connector.store.stats.loaded_blocks.values()) == 3  # three blocks hit and loaded, two unused


def test_media_that_cannot_be_keyed_are_not_cached(llava, connector):
    ids, pixels = prompt(5, 30, seed=4), image(4)
    two = torch.cat([pixels, image(5)])  # two images for one placeholder run
    assert not prompt_media({"input_ids": ids, "pixel_values": two}, llava.config, ids[0].tolist()).keyable
    plan = connector.before_prefill(ids, media={"input_ids": ids, "pixel_values": two})
    assert plan.num_cached_tokens == 0 and torch.equal(plan.generate_kwargs()["pixel_values"], two)
    assert connector.after_request(ids[0], plan.cache, media={"pixel_values": two}) == 0
    assert connector.store.usage()["CPU"]["blocks"] == 0
