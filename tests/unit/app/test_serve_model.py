"""`kvtier serve-model`'s OpenAI-compatible server over a tiny random Llama (byte tokenizer):
outputs equal transformers' continuous batching alone, streaming, bad requests, disconnects.
The tests through a running engine are marked ``slow`` (~35 s together on 2 cores)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

pytest.importorskip("transformers")

from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvtier.app.cb_engine import ContinuousEngine, EngineOptions  # noqa: E402
from kvtier.app.models import byte_tokenizer, render_chat  # noqa: E402
from kvtier.app.openai_api import Limits  # noqa: E402
from kvtier.app.serve_model import Detokenizer, make_app  # noqa: E402
from kvtier.config import StoreConfig  # noqa: E402

MODEL = "tiny"
OPTIONS = EngineOptions(page_size=32, num_blocks=64, max_batch_tokens=256)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      initializer_range=0.5, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(cfg).eval()


def make_engine(model, tokenizer, store_config=None) -> ContinuousEngine:
    engine = ContinuousEngine(model, tokenizer, MODEL, OPTIONS, store_config, model_revision="r1")
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(model, tokenizer, tmp_path_factory):
    config = StoreConfig(gpu_bytes=0, cpu_bytes=16 << 20, disk_bytes=32 << 20, block_size=16,
                         data_dir=tmp_path_factory.mktemp("serve"))
    engine = make_engine(model, tokenizer, config)
    yield engine
    engine.close()


@pytest.fixture
async def client(engine):
    limits = Limits((MODEL,), max_model_len=1024, default_max_tokens=16, max_tokens_limit=960)
    client = TestClient(TestServer(make_app(engine, limits, close_engine=False)))
    await client.start_server()
    yield client
    await client.close()


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": content}], **extra}


async def stream_events(response) -> list:
    events = []
    async for line in response.content:
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[len(b"data: "):]
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


@pytest.mark.slow
async def test_completion_matches_continuous_batching_without_kvtier(client, model, tokenizer):
    body = chat("tell me about caches", max_tokens=12)
    first = await (await client.post("/v1/chat/completions", json=body)).json()
    again = await (await client.post("/v1/chat/completions", json=body)).json()
    baseline = make_engine(model, tokenizer)
    try:
        prompt = render_chat(tokenizer, body["messages"])
        steps = [step async for step in baseline.generate(prompt, 12)]
    finally:
        baseline.close()
    expected = tokenizer.decode([t for s in steps for t in s.token_ids], skip_special_tokens=True)
    assert first["choices"][0]["message"]["content"] == expected == again["choices"][0]["message"]["content"]
    assert first["usage"]["prompt_tokens"] == len(prompt)
    cached = again["kvtier"]["cached_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(cached.values()) > 0
    assert (len(prompt) - 1) // 16 * 16 == sum(cached.values())


@pytest.mark.slow
async def test_stream_sends_the_same_text_then_usage_and_done(client):
    body = chat("streaming please", max_tokens=10)
    plain = await (await client.post("/v1/chat/completions", json=body)).json()
    response = await client.post("/v1/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = await stream_events(response)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert events[-2]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


@pytest.mark.slow
async def test_stop_string_cuts_the_text(client):
    plain = await (await client.post("/v1/chat/completions", json=chat("stop test", max_tokens=24))).json()
    text = plain["choices"][0]["message"]["content"]
    stop = text[5:8]
    cut = await (await client.post("/v1/chat/completions", json=chat("stop test", max_tokens=24, stop=[stop]))).json()
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL}, 400, "messages"),
    (chat("x", temperature=0.5), 400, "temperature"),
    (chat("x", max_tokens=0), 400, "max_completion_tokens"),
    (chat("x", max_completion_tokens=961), 400, "max_completion_tokens"),
    (chat("x", n=2), 400, "n"),
    (chat("x", stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (chat("x", tools=[{"type": "function"}]), 400, "tools"),
    (chat("x", stream="yes"), 400, "stream"),
    (chat("x", stream_options={"include_usage": True}), 400, "stream_options"),
    ({**chat("x"), "model": "gpt-4"}, 404, "model"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (chat("x" * 1200), 400, "messages"),
])
async def test_bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving(client, body, status, param):
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == status
    error = (await response.json())["error"]
    assert error["param"] == param and error["message"]
    ok = await client.post("/v1/chat/completions", json=chat("still there?", max_tokens=2))
    assert ok.status == 200


@pytest.mark.slow
async def test_invalid_json_is_400(client):
    response = await client.post("/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status == 400 and "JSON" in (await response.json())["error"]["message"]


@pytest.mark.slow
async def test_client_disconnect_mid_stream_frees_its_request(client, engine, monkeypatch):
    cancelled = []
    cancel = engine.manager.cancel_request
    monkeypatch.setattr(engine.manager, "cancel_request", lambda rid: (cancelled.append(rid), cancel(rid)))
    response = await client.post("/v1/chat/completions", json=chat("a long answer", max_tokens=900, stream=True))
    assert response.status == 200
    seen = 0
    async for line in response.content:
        seen += line.startswith(b"data: ")
        if seen >= 3:
            break
    response.close()  # the client goes away mid-stream
    scheduler = engine.manager.batch_processor.scheduler
    deadline = time.monotonic() + 10
    while (scheduler.active_requests or scheduler.waiting_requests) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert len(cancelled) == 1, "expected the request to be cancelled, not to run to its end"
    assert not scheduler.active_requests and not scheduler.waiting_requests
    assert not engine.connector._progress  # the connector let go of it too
    engine.connector.store.check_invariants()


@pytest.mark.slow
async def test_concurrent_streams_equal_sequential_answers(client):
    bodies = [chat(f"user {i} asks about block {i * 7}", max_tokens=8) for i in range(8)]
    sequential = [(await (await client.post("/v1/chat/completions", json=b)).json())["choices"][0]["message"]["content"]
                  for b in bodies]

    async def one(body):
        events = await stream_events(await client.post("/v1/chat/completions", json={**body, "stream": True}))
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])

    assert await asyncio.gather(*(one(b) for b in bodies)) == sequential


@pytest.mark.slow
async def test_models_health_and_stats(client):
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (await client.get("/health")).status == 200
    await client.post("/v1/chat/completions", json=chat("count me", max_tokens=2))
    stats = await (await client.get("/kvtier/stats")).json()
    assert stats["kvtier"] is True and stats["requests"] >= 1 and stats["prompt_tokens"] > 0


def test_detokenizer_holds_back_a_possible_stop_string(tokenizer):
    ids = tokenizer("hello world, stop here", add_special_tokens=False)["input_ids"]
    text = Detokenizer(tokenizer, ["stop"])
    released = "".join(text.add([i]) for i in ids)
    assert text.stopped and released == "hello world, " == text.text
    plain = Detokenizer(tokenizer, [])
    assert "".join(plain.add([i]) for i in ids) + plain.flush() == "hello world, stop here"


def test_parse_sampling_servers_take_temperature_and_refuse_greedy_and_seeds():
    from kvtier.app.openai_api import ApiError, parse_chat_request

    limits = Limits((MODEL,), max_model_len=1024, sampling="sample")
    parsed = parse_chat_request(chat("x", temperature=0.7, top_p=0.9, max_completion_tokens=5, stop="\n"), limits)
    assert (parsed.temperature, parsed.top_p, parsed.max_tokens, parsed.stop) == (0.7, 0.9, 5, ["\n"])
    for body, param in ((chat("x", temperature=0), "temperature"), (chat("x", temperature=1.0, seed=3), "seed"),
                        (chat("x", temperature=float("nan")), "temperature"), (chat("x", top_p=0), "top_p"),
                        (chat("x", max_tokens=True), "max_tokens"), ([1, 2], None)):
        with pytest.raises(ApiError) as err:
            parse_chat_request(body, limits)
        assert err.value.status == 400 and err.value.param == param
    greedy = parse_chat_request(chat("x", temperature=0, top_p=1, seed=7), Limits((MODEL,), 1024))
    assert greedy.temperature is None and greedy.seed == 7


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["serve-model", "tiny-gemma2", "--port", "0"],
    ["demo", "--engine", "continuous", "--model", "tiny-gpt-oss", "--users", "1", "--quick"],
])
def test_commands_refuse_a_family_the_paged_connector_cannot_serve(argv, tmp_path):
    """A clean one-line error naming the layer kinds, before any server or pass starts."""
    from click.testing import CliRunner

    from kvtier.app.cli import main

    result = CliRunner().invoke(main, [*argv, "--data-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "full-attention models only" in result.output and "sliding(8)" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
