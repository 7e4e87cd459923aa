"""A full DISK (D3): a cap smaller than one record, a full filesystem under LMDB (SIGBUS)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess

import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.store import TieredStore
from kvtier.types import KVSpec
from tests.conftest import BLOCK_SIZE, NS, chain, random_blocks

_FORK = multiprocessing.get_context("fork")


def test_disk_cap_smaller_than_one_record_stores_in_memory_and_never_raises_regression_d3(tmp_path, opened):
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=512, block_size=BLOCK_SIZE, dtype=torch.float32)
    config = StoreConfig(gpu_bytes=2 * spec.block_nbytes, cpu_bytes=0, disk_bytes=4096, block_size=BLOCK_SIZE,
                         data_dir=tmp_path)
    store = opened(TieredStore(spec, config, NS, device="cpu"))
    for r in range(4):
        hashes = chain(2, spec, NS, start=100 * r)
        assert store.store(hashes, random_blocks(spec, 2, seed=r)) == 2
    store.flush()
    assert len(store.disk) == 0 and store.disk.used_bytes == 0
    store.check_invariants()


def _fill_small_filesystem_child(data_dir, conn) -> None:
    import faulthandler

    faulthandler.disable()  # the expected SIGBUS needs no Python traceback dump
    torch.set_num_threads(1)
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)  # 64 KiB
    config = StoreConfig(gpu_bytes=2 * spec.block_nbytes, cpu_bytes=0, disk_bytes=16 << 20, block_size=16,
                         data_dir=data_dir)
    store = TieredStore(spec, config, NS, device="cpu")
    for i in range(60):  # ~3.8 MiB through a 2 MiB filesystem
        block = torch.full((1, *spec.block_shape), float(i))
        store.store(chain(1, spec, NS, start=100 * i), block)
    store.close()
    conn.send("done")


@pytest.fixture
def small_filesystem(tmp_path):
    """A 2 MiB tmpfs (needs root; skipped elsewhere)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                        capture_output=True).returncode
    if rc != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_full_filesystem_under_the_disk_tier_does_not_kill_the_process_regression_d3(small_filesystem):
    parent, child = _FORK.Pipe(duplex=False)
    proc = _FORK.Process(target=_fill_small_filesystem_child, args=(small_filesystem / "kv", child), daemon=True)
    proc.start()
    child.close()
    finished = parent.poll(30)
    proc.join(10)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.exitcode == 0 and finished, f"the process died with exit code {proc.exitcode} (-7 = SIGBUS)"

