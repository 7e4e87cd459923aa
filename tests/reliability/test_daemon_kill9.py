"""Durability of ``kvtier serve --durable`` under kill -9: a real daemon subprocess takes puts
from a RemoteTier on another thread and is killed at random moments; after each restart on
the same data directory every acknowledged block reads back bit-exact, and no block that is
served is ever different from what was sent (unacknowledged ones are exact or missing).
At the end the daemon's DISK is checked directly: every record verifies, index and
database agree."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from kvtier.records import ReadStatus
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.remote import RemoteTier
from kvtier.types import KVSpec
from tests.conftest import random_blocks
from tests.unit.server.conftest import NAMESPACE, spawn  # noqa: F401  (spawn: the daemon fixture, defined beside the server's tests)

pytestmark = pytest.mark.slow  # a daemon subprocess killed and restarted

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)  # 32 KiB blocks
ROUNDS = 3
BATCH = 8
ARGS = ("--durable", "--cpu-bytes", "4MiB", "--disk-bytes", "256MiB", "--threads", "2", "--num-io-threads", "1")


class Writer(threading.Thread):
    """Puts batches of fresh random blocks until stopped; remembers what was sent and acked."""

    def __init__(self, remote: RemoteTier, rng: random.Random, sent: dict, acked: set) -> None:
        super().__init__(daemon=True)
        self.remote, self.rng, self.sent, self.acked = remote, rng, sent, acked
        self.stop = threading.Event()
        self.first_ack = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            hs = [self.rng.randbytes(32) for _ in range(BATCH)]
            blocks = random_blocks(SPEC, BATCH, seed=self.rng.randrange(1 << 30))
            for h, block in zip(hs, blocks):
                self.sent[h] = block
            for h, ok in zip(hs, self.remote.put(NAMESPACE, hs, list(blocks))):
                if ok:
                    self.acked.add(h)
                    self.first_ack.set()


def read_back(remote: RemoteTier, sent: dict, acked: set) -> tuple[int, int, int]:
    """``(acked blocks lost, corrupt or wrong blocks served, unacked blocks found)``."""
    lost = corrupt = found = 0
    hs = list(sent)
    for start in range(0, len(hs), 64):
        part = hs[start : start + 64]
        for h in part:  # one call per block: a missing block must not hide the ones after it
            out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
            (status,) = remote.get_into(NAMESPACE, [h], [out])
            if status is ReadStatus.OK:
                if not torch.equal(out.view(torch.uint8), sent[h].view(torch.uint8)):
                    corrupt += 1
                found += h not in acked
            elif status is ReadStatus.MISSING:
                lost += h in acked
            else:
                corrupt += status is ReadStatus.CORRUPT
                lost += h in acked
    return lost, corrupt, found


def test_kill9_during_puts_loses_no_acknowledged_block(spawn, tmp_path):
    rng = random.Random(20261130)
    data_dir = tmp_path / "data"
    sent: dict[bytes, torch.Tensor] = {}
    acked: set[bytes] = set()
    totals = {"lost": 0, "corrupt": 0, "unacked_found": 0}
    for round_ in range(ROUNDS + 1):
        daemon = spawn(*ARGS, data_dir=data_dir)
        remote = RemoteTier(daemon.url, timeout_s=5.0)
        try:
            remote.register(NAMESPACE, SPEC)
            lost, corrupt, found = read_back(remote, sent, acked)
            totals["lost"] += lost
            totals["corrupt"] += corrupt
            totals["unacked_found"] = found
            assert (lost, corrupt) == (0, 0), f"round {round_}: {lost} acknowledged blocks lost, {corrupt} corrupt served"
            if round_ == ROUNDS:
                break
            writer = Writer(remote, rng, sent, acked)
            writer.start()
            assert writer.first_ack.wait(30), "no put was acknowledged"
            time.sleep(rng.uniform(0.05, 0.6))
            daemon.kill(signal.SIGKILL)
            writer.stop.set()
            writer.join(30)
            assert not writer.is_alive()
        finally:
            remote.close()
    daemon.kill(signal.SIGKILL)
    print(f"\nkill -9 x{ROUNDS}: {len(sent)} blocks sent, {len(acked)} acknowledged; acknowledged lost "
          f"{totals['lost']}, corrupt served {totals['corrupt']}, unacknowledged found intact {totals['unacked_found']}")
    assert len(acked) >= ROUNDS * BATCH

    # daemon side: every record on DISK verifies and the index agrees with the database
    disk = DiskTier(data_dir / NAMESPACE.hex() / "disk", 256 << 20)
    try:
        disk.check()
        assert acked <= set(disk.lru_order())
        out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
        for h in disk.lru_order():
            assert disk.read_into(h, NAMESPACE, out) is ReadStatus.OK
            assert torch.equal(out.view(torch.uint8), sent[h].view(torch.uint8))
    finally:
        disk.close()
    assert os.path.exists(data_dir / NAMESPACE.hex() / "spec.msgpack")
