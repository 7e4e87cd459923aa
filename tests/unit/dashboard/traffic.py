"""Multi-turn chat traffic against a TieredStore, from a thread (for the dashboard tests).

Each request looks up and loads its prompt's cached prefix, then stores the prompt and the
reply; prompts grow turn by turn, conversations take turns, and their working set exceeds
the GPU and CPU pools, so blocks hit in every tier, spill down and get evicted.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from kvtier.config import StoreConfig
from kvtier.connectors.ttft import PrefillRate
from kvtier.hashing import KeyContext, block_hashes_for, content_keys
from kvtier.store import TieredStore
from kvtier.store.results import PromptInfo
from kvtier.tiers.disk import record_footprint
from kvtier.types import KVSpec

PREFILL_S_PER_TOKEN = 2e-4
"""The traffic's pretend engine prefills 5,000 tokens a second (for the TTFT-saved figure)."""
SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float16)  # 16 KiB blocks


def traffic_store(data_dir, gpu_blocks: int = 24, cpu_blocks: int = 48, disk_blocks: int = 400,
                  model_id: str = "dashboard-test") -> TieredStore:
    namespace = KeyContext(model_id=model_id, dtype="float16", block_size=SPEC.block_size).namespace()
    config = StoreConfig(
        gpu_bytes=gpu_blocks * SPEC.block_nbytes, cpu_bytes=cpu_blocks * SPEC.block_nbytes,
        disk_bytes=disk_blocks * record_footprint(SPEC.block_nbytes), block_size=SPEC.block_size,
        data_dir=data_dir, flush_on_close=False,
    )
    return TieredStore(SPEC, config, namespace, device="cpu", emulate_gpu=True)


class Traffic:
    """Runs :meth:`request` in a loop on a daemon thread until :meth:`stop` (or ``max_requests``).

    Args:
        store: the store under load.
        conversations: chats taking turns; each turn adds ``turn_tokens`` to its prompt.
        pause_s: sleep between requests (keeps a 2-core machine responsive).
    """

    def __init__(self, store: TieredStore, conversations: int = 12, turn_tokens: int = 48,
                 pause_s: float = 0.005, max_requests: int = 100_000, seed: int = 0) -> None:
        self.store, self.turn_tokens, self.pause_s, self.max_requests = store, turn_tokens, pause_s, max_requests
        self.rng = random.Random(seed)
        self.prompts = [[self.rng.randrange(32000) for _ in range(turn_tokens)] for _ in range(conversations)]
        self.requests = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-test-traffic", daemon=True)
        self._blocks = torch.randn((64, *SPEC.block_shape)).to(SPEC.dtype)
        self.prefill = PrefillRate()

    def request(self) -> None:
        """One turn of one conversation (every 7th request: a unique prompt that misses)."""
        if self.requests % 7 == 6:
            tokens = [self.rng.randrange(32000) for _ in range(4 * SPEC.block_size)]
        else:
            c = self.requests % len(self.prompts)
            tokens = self.prompts[c]
            if len(tokens) > 40 * SPEC.block_size:  # a new chat in that slot
                tokens = self.prompts[c] = []
            tokens += [self.rng.randrange(32000) for _ in range(self.turn_tokens)]
        hashes = block_hashes_for(tokens, self.store.namespace, SPEC.block_size)
        t0 = time.perf_counter()
        loaded = self.store.load(hashes, prompt=PromptInfo(len(tokens), content_keys(tokens, SPEC.block_size)))
        load_s = time.perf_counter() - t0
        loaded.lease.release()
        # as a connector counts it (kvtier.connectors.ttft), with a made-up prefill rate
        cached = len(loaded.block_ids) * SPEC.block_size
        saving = self.prefill.saving(cached, load_s)
        self.store.record_computed_tokens(len(tokens) - cached, *(saving or (None, 0.0)))
        self.prefill.observe(len(tokens) - cached, PREFILL_S_PER_TOKEN * (len(tokens) - cached) + 0.01)
        n = len(hashes)
        blocks = self._blocks[:n] if n <= len(self._blocks) else torch.cat([self._blocks] * (n // 64 + 1))[:n]
        self.store.store(hashes, blocks)
        self.requests += 1

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.requests < self.max_requests:
                self.request()
                time.sleep(self.pause_s)
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)

    def start(self) -> "Traffic":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "traffic thread did not stop"
        if self.errors:
            raise self.errors[0]
