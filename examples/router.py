"""A cache-aware router over several engine processes, fed only by their KV events.

Each engine is its own process with its own kvtier store (a GPU pool and a CPU pool; blocks
of a tiny spec: what matters here is which blocks an engine holds, not their bytes) and an
HTTP app: ``POST /generate`` loads the prompt's cached prefix (as the transformers connector
does) and stores the blocks of prompt + reply; ``GET /v1/events`` streams its KV events
(kvtier.dashboard.events: vLLM's BlockStored / BlockRemoved / AllBlocksCleared, with a
snapshot first and a resume cursor).

The router subscribes to every engine's stream and keeps, per engine, the set of block hashes
it holds in any tier. For each request (multi-user ShareGPT chats, in arrival order) it hashes
the prompt with the engines' key (:func:`kvtier.hashing.block_hashes_for`) and sends it to:

- ``round_robin``: the next engine in turn;
- ``prefix``: the engine holding the longest cached prefix of the prompt (ties: the engine
  with the fewest requests so far). A prompt no engine holds half of (a new user: only the
  shared system prompt matches) goes to the engine with the fewest requests, so users spread
  out instead of all following the system prompt to one engine.

Each policy runs on fresh engines; the hit rate is the engines' own count of prompt tokens
served from their cache. The router waits until its view of an engine has caught up with the
events of that engine's previous reply (``events_seq``), so the comparison measures routing,
not event latency.

    python examples/router.py                          # 4 engines, 200 ShareGPT users
    python examples/router.py --engines 8 --users 400 --json router.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK_SIZE = 16
MODEL_ID = "router-example"
MIN_MATCH = 0.5
"""A prompt whose best match is shorter than this fraction of its blocks is routed by load."""


def key_context():
    from kvtier.hashing import KeyContext

    return KeyContext(MODEL_ID, dtype="float16", block_size=BLOCK_SIZE)


# -- an engine process ---------------------------------------------------------------------------------
def engine_main(index: int, gpu_blocks: int, cpu_blocks: int, data_dir: str, ports: "multiprocessing.Queue") -> None:
    """Serve one engine until killed: its store, ``/generate`` and ``/v1/events``."""
    import torch
    from aiohttp import web

    from kvtier.config import StoreConfig
    from kvtier.dashboard import setup_events
    from kvtier.hashing import block_hashes_for
    from kvtier.store import TieredStore
    from kvtier.types import KVSpec

    spec = KVSpec(1, 1, 1, BLOCK_SIZE, torch.float16)
    config = StoreConfig(gpu_bytes=gpu_blocks * spec.block_nbytes, cpu_bytes=cpu_blocks * spec.block_nbytes,
                         disk_bytes=0, block_size=BLOCK_SIZE, data_dir=Path(data_dir) / f"engine-{index}",
                         flush_on_close=False)
    namespace = key_context().namespace()
    store = TieredStore(spec, config, namespace, device="cpu", emulate_gpu=True)

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        prompt, stored = body["prompt"], body["stored"]
        hashes = block_hashes_for(stored, namespace, BLOCK_SIZE)
        loaded = store.load(hashes[: (len(prompt) - 1) // BLOCK_SIZE])  # the prefill: the cached prefix ...
        loaded.lease.release()
        store.store_with(hashes, lambda indices, block_ids: None)  # ... and the new blocks (no bytes here)
        return web.json_response({"cached_tokens": len(loaded.block_ids) * BLOCK_SIZE, "prompt_tokens": len(prompt),
                                  "events_seq": store.events.seq})

    async def serve() -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", generate)
        setup_events(app, lambda request: {MODEL_ID: store}, keepalive_s=1.0)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.put((index, runner.addresses[0][1]))
        await asyncio.Event().wait()

    asyncio.run(serve())


# -- the router ----------------------------------------------------------------------------------------
class EngineView:
    """What one engine holds, from its event stream: block hash -> tiers holding it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.held: dict[str, set[str]] = {}
        self.seq = 0
        self.requests = 0
        self.caught_up = asyncio.Condition()

    def prefix_blocks(self, hashes: list[str]) -> int:
        n = 0
        for h in hashes:
            if not self.held.get(h):
                break
            n += 1
        return n

    def apply(self, batch: dict) -> None:
        for event in batch["events"]:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                self.held.clear()
            elif kind == "BlockStored":
                for h in event["block_hashes"]:
                    self.held.setdefault(h, set()).add(event["medium"])
            elif kind == "BlockRemoved":
                for h in event["block_hashes"]:
                    tiers = self.held.get(h)
                    if tiers is not None:
                        tiers.discard(event["medium"])
                        if not tiers:
                            del self.held[h]
        self.seq = batch["seq"]

    async def follow(self, session) -> None:
        """Apply the engine's events as they come (reconnecting with the cursor)."""
        while True:
            try:
                async with session.get(f"{self.url}/v1/events", params={"cursor": str(self.seq)} if self.seq else {},
                                       timeout=None) as response:
                    async for raw in response.content:
                        line = raw.decode().rstrip("\n")
                        if line.startswith("data: "):
                            self.apply(json.loads(line[6:]))
                            async with self.caught_up:
                                self.caught_up.notify_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # the engine restarts or the stream broke: resume from the cursor
                await asyncio.sleep(0.1)

    async def wait_for(self, seq: int, timeout_s: float = 10.0) -> None:
        async with self.caught_up:
            await asyncio.wait_for(self.caught_up.wait_for(lambda: self.seq >= seq), timeout_s)


async def route_all(urls: list[str], requests: list, policy: str) -> dict:
    import aiohttp

    from kvtier.hashing import block_hashes_for

    namespace = key_context().namespace()
    views = [EngineView(url) for url in urls]
    async with aiohttp.ClientSession() as session:
        followers = [asyncio.create_task(v.follow(session)) for v in views]
        for view in views:
            await view.wait_for(0)
        cached = prompt_tokens = 0
        turn = 0
        started = time.perf_counter()
        for r in requests:
            if policy == "round_robin":
                view = views[turn % len(views)]
                turn += 1
            else:
                hashes = [h.hex() for h in block_hashes_for(r.prompt, namespace, BLOCK_SIZE)]
                view = max(views, key=lambda v: (v.prefix_blocks(hashes), -v.requests))
                if view.prefix_blocks(hashes) < MIN_MATCH * len(hashes):
                    view = min(views, key=lambda v: v.requests)
            view.requests += 1
            async with session.post(f"{view.url}/generate", json={"prompt": r.prompt, "stored": r.stored}) as response:
                reply = await response.json()
            cached += reply["cached_tokens"]
            prompt_tokens += reply["prompt_tokens"]
            await view.wait_for(reply["events_seq"])
        elapsed = time.perf_counter() - started
        for task in followers:
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
    return {"policy": policy, "hit_rate": cached / prompt_tokens, "cached_tokens": cached,
            "prompt_tokens": prompt_tokens, "requests_per_engine": [v.requests for v in views],
            "seconds": elapsed}


def start_engines(count: int, gpu_blocks: int, cpu_blocks: int, data_dir: str) -> tuple[list, list[str]]:
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    procs = [ctx.Process(target=engine_main, args=(i, gpu_blocks, cpu_blocks, data_dir, ports), daemon=True)
             for i in range(count)]
    for p in procs:
        p.start()
    found = dict(ports.get(timeout=120) for _ in procs)
    return procs, [f"http://127.0.0.1:{found[i]}" for i in range(count)]


def stop_engines(procs: list) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--users", type=int, default=200, help="ShareGPT users chatting at once")
    parser.add_argument("--turns", type=int, default=6, help="turns per user at most")
    parser.add_argument("--gpu-blocks", type=int, default=1024, help="per engine")
    parser.add_argument("--cpu-blocks", type=int, default=2048, help="per engine")
    parser.add_argument("--tokenizer", choices=["words", "smollm2"], default="words")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    import tempfile

    from kvtier.app.traces import sharegpt_requests

    requests = sharegpt_requests(args.users, args.turns, args.seed, args.tokenizer)
    total = sum(len(r.prompt) for r in requests)
    print(f"{len(requests)} requests from {args.users} ShareGPT users (<= {args.turns} turns), {total:,} prompt tokens; "
          f"{args.engines} engines x ({args.gpu_blocks} GPU + {args.cpu_blocks} CPU blocks of {BLOCK_SIZE} tokens)")
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-router-") as tmp:
        for policy in ("round_robin", "prefix"):
            procs, urls = start_engines(args.engines, args.gpu_blocks, args.cpu_blocks, tmp)
            try:
                results.append(asyncio.run(route_all(urls, requests, policy)))
            finally:
                stop_engines(procs)
    print(f"{'policy':<13}{'hit rate':>9}{'cached tokens':>15}  requests per engine")
    for r in results:
        print(f"{r['policy']:<13}{r['hit_rate']:>9.1%}{r['cached_tokens']:>15,}  {r['requests_per_engine']}")
    gain = results[1]["hit_rate"] / results[0]["hit_rate"] if results[0]["hit_rate"] else float("inf")
    print(f"prefix-aware routing from KV events: {gain:.2f}x the round-robin hit rate "
          f"(load average {os.getloadavg()[0]:.1f})")
    if args.json is not None:
        args.json.write_text(json.dumps({"requests": len(requests), "prompt_tokens": total, "engines": args.engines,
                                         "users": args.users, "results": results}, indent=2))


if __name__ == "__main__":
    main()
