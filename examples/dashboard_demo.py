"""The demo's chats with the live dashboard served from the engine's own process.

Runs ShareGPT conversations through SmolLM2 (``--tiny``: a random-weight model) with kvtier's
transformers connector, exactly as ``kvtier demo`` does (each turn without, then with kvtier),
while ``/dashboard``, ``/v1/stats``, ``/metrics``, ``/v1/events`` and ``/v1/explain`` are served
over the connector's store. The connector times every prefill, so "TTFT saved" fills in.

    KVTIER_DATA_DIR=$PWD/.data python examples/dashboard_demo.py             # open the URL it prints
    python examples/dashboard_demo.py --screenshot docs/dashboard.png        # headless chromium

``--screenshot`` needs playwright (``pip install playwright``) and a chromium binary
(``apt-get install chromium``, or ``KVTIER_CHROMIUM``); the page is 1280 px wide.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def serve(stores: dict, port: int) -> tuple[str, "Callable[[], None]"]:
    """Serve the observability routes over ``stores`` from a thread; returns its URL and
    a function that stops it."""
    from aiohttp import web

    from kvtier.dashboard import setup_events, setup_explain, setup_observability

    loop = asyncio.new_event_loop()
    started = threading.Event()
    url: list[str] = []
    runners: list = []

    async def start() -> None:
        app = web.Application()
        setup_observability(app, stores, interval_s=1.0, max_samples=900)
        setup_events(app, lambda request: stores)
        setup_explain(app, lambda request: stores)
        runner = web.AppRunner(app)
        runners.append(runner)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        url.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runners[0].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=run, name="kvtier-dashboard", daemon=True).start()
    started.wait(30)
    return url[0], stop


def screenshot(url: str, path: Path) -> None:
    """The page at 1280 px, after it drew its charts (a few polls)."""
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("KVTIER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(url + "/dashboard")
        page.wait_for_function("Number(document.body.dataset.renders || 0) >= 3", timeout=60_000)
        path.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(path), full_page=True)
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a random-weight model (no download, seconds)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--screenshot", type=Path, default=None, help="save the page here when the run ends")
    parser.add_argument("--hold", action="store_true", help="keep serving after the run (Ctrl-C to stop)")
    args = parser.parse_args()

    import torch

    from kvtier.app.demo import DemoOptions, run_turns, warm_up
    from kvtier.app.models import load_model
    from kvtier.app.sharegpt import select_conversations
    from kvtier.config import StoreConfig
    from kvtier.connectors.hf import HFConnector

    options = DemoOptions(model="tiny-llama" if args.tiny else "smollm2", num_conversations=args.conversations,
                          num_turns=args.turns, max_new_tokens=args.max_new_tokens)
    model, tokenizer, model_id = load_model(options.model)
    conversations, _ = select_conversations(tokenizer, options.num_conversations, options.num_turns,
                                            max_message_tokens=options.max_message_tokens,
                                            max_prompt_tokens=options.max_prompt_tokens,
                                            model_reply_tokens=options.max_new_tokens)
    with torch.inference_mode():
        connector = HFConnector.from_model(model, StoreConfig.from_env(), model_id=model_id)
        url, stop = serve({connector.store.name: connector.store}, args.port)
        print(f"dashboard: {url}/dashboard", flush=True)
        warm_up(model)
        turns = run_turns(model, tokenizer, connector, conversations, options,
                          lambda t: print(f"conversation {t.conversation} turn {t.turn}: {t.cached_tokens} of "
                                          f"{t.prompt_tokens} tokens cached, TTFT {t.ttft_with_s * 1e3:.0f} ms "
                                          f"(without {t.ttft_without_s * 1e3:.0f} ms)", flush=True))
        stats = connector.store.stats
        print(f"{len(turns)} turns; TTFT saved {stats.ttft_saved_s or 0:.2f} s as the connector measured it "
              f"(lost {stats.ttft_lost_s:.2f} s); measured: "
              f"{sum(t.ttft_without_s - t.ttft_with_s for t in turns):.2f} s without - with", flush=True)
        time.sleep(2.5)  # two more samples after the last turn
        if args.screenshot is not None:
            screenshot(url, args.screenshot)
            print(f"screenshot: {args.screenshot}")
        if args.hold:
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        stop()
        connector.close()


if __name__ == "__main__":
    main()
