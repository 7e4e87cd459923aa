"""Fault injection end to end: a tiny random Llama chats through the HF connector while the
DISK (or REMOTE) tier misbehaves; every turn's greedy output must equal a cold run's, token
for token (guarantee 1: a faulty read is a miss and the engine recomputes; it never feeds the
model other K/V). Each run restarts the engine halfway, so later turns read from DISK.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.config import StoreConfig
from kvtier.connectors.hf import HFConnector, kv_spec_for
from kvtier.store import TieredStore
from kvtier.testing import DISK_READ_FAULTS, DISK_WRITE_FAULTS, Fault, FaultPlan, MemoryRemote
from kvtier.testing import inject_disk_faults, inject_remote_faults

BLOCK = 16
TURNS = 4


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _generate(llama, input_ids, connector=None):
    kwargs, plan = {}, None
    if connector is not None:
        plan = connector.before_prefill(input_ids)
        kwargs = plan.generate_kwargs()
    with torch.inference_mode():
        out = llama.generate(input_ids, max_new_tokens=5, do_sample=False, pad_token_id=0, **kwargs)
    if connector is not None:
        connector.after_request(out[0], plan.cache)
    return out[0, input_ids.shape[1] :].tolist(), plan


def _connector(llama, tmp_path, remote=None) -> HFConnector:
    nbytes = kv_spec_for(llama, BLOCK).block_nbytes
    config = StoreConfig(gpu_bytes=3 * nbytes, cpu_bytes=2 * nbytes, disk_bytes=8 << 20, block_size=BLOCK,
                         data_dir=tmp_path)
    conn = HFConnector.from_model(llama, config, model_id="tiny-llama")
    if remote is None:
        return conn
    conn.close()
    store = TieredStore(conn.store.spec, config, conn.namespace, device="cpu", remote=remote)
    return HFConnector(llama, store, conn.key_context)


def _chat_under_faults(llama, tmp_path, plan: FaultPlan, remote=None) -> int:
    """TURNS turns, a restart after the second; faults on throughout. Returns cached tokens used."""
    history, cached = _prompt(40, seed=1), 0
    conn = _connector(llama, tmp_path, remote)
    try:
        for turn in range(TURNS):
            if turn == 2:
                conn.close()
                conn = _connector(llama, tmp_path, remote)
            cold, _ = _generate(llama, history)
            with inject_disk_faults(conn.store, plan):
                if remote is None:
                    warm, plan_ = _generate(llama, history, conn)
                else:
                    with inject_remote_faults(remote, plan):
                        warm, plan_ = _generate(llama, history, conn)
                        conn.store.wait_for_writes()  # the background puts, under the faults too
            assert warm == cold, f"turn {turn}: output differs from a cold run under {plan.faults}"
            cached += plan_.num_cached_tokens
            history = torch.cat([history, torch.tensor([cold]), _prompt(19, seed=10 + turn)], dim=1)
        conn.store.check_invariants()
    finally:
        conn.close()
    return cached


# a multi-turn generate per fault: a corrupt read and a full DISK stay in the fast lane
FAST_DISK_FAULTS = {("read", "corrupt"), ("write", "full")}
DISK_FAULT_CASES = [("read", k) for k in DISK_READ_FAULTS] + [("write", k) for k in DISK_WRITE_FAULTS if k != "raise"]


@pytest.mark.parametrize("op,kind", [case if case in FAST_DISK_FAULTS else pytest.param(*case, marks=pytest.mark.slow)
                                     for case in DISK_FAULT_CASES])
def test_greedy_output_equals_a_cold_run_under_disk_faults(llama, tmp_path, op, kind):
    plan = FaultPlan([Fault(op, kind, p=0.5, delay_s=0.005)], seed=5)
    cached = _chat_under_faults(llama, tmp_path, plan)
    assert plan.count() > 0 and cached > 0, "no fault fired or nothing was reused: nothing was tested"


@pytest.mark.parametrize("op,kind", [("get", k) for k in ("unavailable", "timeout", "corrupt", "truncate", "missing")]
                         + [("put", k) for k in ("full", "corrupt", "truncate")])
@pytest.mark.slow  # a multi-turn generate per fault
def test_greedy_output_equals_a_cold_run_under_remote_faults(llama, tmp_path, op, kind):
    remote = MemoryRemote(timeout_s=0.005)
    plan = FaultPlan([Fault(op, kind, p=0.5, delay_s=0.005)], seed=5)
    cached = _chat_under_faults(llama, tmp_path / "a", plan, remote=remote)
    # a second engine on another data directory: its first turns come from REMOTE
    cached += _chat_under_faults(llama, tmp_path / "b", plan, remote=remote)
    assert plan.count() > 0 and cached > 0, "no fault fired or nothing was reused: nothing was tested"
