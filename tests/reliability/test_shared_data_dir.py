"""A second process on a data dir another process holds is refused, or stays within the cap."""

from __future__ import annotations

import multiprocessing
import os
import signal

import lmdb
import torch

from tests.conftest import NS, chain, open_store, random_blocks, tiny_spec

SPEC = tiny_spec()
_FORK = multiprocessing.get_context("fork")


def _second_writer_child(data_dir, conn) -> None:
    """Child: open the store, then (when told) fill its DISK tier, then hold it open."""
    torch.set_num_threads(1)
    store = open_store(data_dir, gpu=1, disk=4)
    conn.send("opened")
    conn.recv()
    for i in range(6):
        store.store(chain(1, SPEC, NS, start=100 + 10 * i), random_blocks(SPEC, 1, seed=i))
    store.flush()
    conn.send("written")
    conn.recv()
    store.close()


def test_second_process_on_the_same_data_dir_is_refused_or_stays_within_the_cap(tmp_path, opened):
    data_dir = tmp_path / "kv"
    ours, theirs = _FORK.Pipe(duplex=True)
    proc = _FORK.Process(target=_second_writer_child, args=(data_dir, theirs), daemon=True)
    proc.start()
    try:
        assert ours.poll(20) and ours.recv() == "opened"
        try:
            store = opened(open_store(data_dir, gpu=1, disk=4))
        except (RuntimeError, OSError, ValueError, lmdb.Error):
            return  # refused with an error: fine
        ours.send("go")
        assert ours.poll(20) and ours.recv() == "written"
        for i in range(6):
            store.store(chain(1, SPEC, NS, start=900 + 10 * i), random_blocks(SPEC, 1, seed=50 + i))
        store.flush()
        with store.disk.env.begin() as txn:
            assert txn.stat()["entries"] <= 4, "DISK cap exceeded"
        store.disk.check()
    finally:
        ours.send("exit")
        ours.send("exit")
        proc.join(10)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)

