"""Asynchronous transfers on the CPU: DISK->CPU prefetch and CPU->DISK spill against the
machine's own limits, and a TTFT timeline showing a prefetch hidden behind engine work.

    python bench/transfers.py [--total-bytes 1GiB] [--repeats 3] [--json PATH] [--dir DIR]

Rows (2 MiB blocks, ``--total-bytes`` moved per measurement, each beside a same-run baseline):

- DISK -> CPU prefetch: ``TieredStore.prefetch(hashes).wait()`` of blocks held only on DISK
  (page cache warm), reads split over ``num_io_threads`` I/O threads straight into the CPU
  slab. Baseline: one ``copy_`` of the same bytes between two preallocated host tensors
  (memcpy bandwidth, torch's default threads).
- CPU -> DISK spill: evicting every block of a full CPU slab, each spilling to DISK (the
  store's eviction path; batched LMDB write transactions). Also ``TieredStore.store`` of new
  blocks into a full slab, which adds copying them in. Baseline: a raw sequential write of the spilled bytes over a
  file written just before (cached pages overwritten in place; no fsync on either side: LMDB runs with
  ``sync=False``; :data:`bench.common.RAW_WRITE_NOTE`, the same as bench/tiers.py's).
  Each also beside its floor, timed in the same rounds (:class:`bench.tiers.StoreFloor`: the
  copies and the xxh3 a verified spill or store makes, in numpy, no kvtier): the floor against
  the raw write (what that work reaches on this machine: measured, not a proven bound), kvtier
  against the floor (a warning under the table when kvtier beats it).
- Overlap: a random-weight model with SmolLM2-135M's exact architecture; a 2,048-token
  history on DISK only (fresh store); the request arrives, the engine is busy for
  ``--busy-ms`` (a sleep: the device busy with other requests' decode steps), then
  prefills the 64-token suffix. TTFT is measured from the end of the busy step (when the engine
  turns to this request) to the first token, and the part of it spent getting the prefix into
  the model's cache is shown apart: without prefetch (the DISK read happens inside
  ``before_prefill``), with ``prefetch`` started at arrival, and with the history already in
  memory (the floor). Medians of 5; the timeline of a prefetch run is printed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    RAW_WRITE_BASELINE, RAW_WRITE_NOTE, Case, Row, apply_threads, arg_parser, measure, print_table, prime_raw_file, raw_write,
    disk_warmup_rounds, write_json, write_plot,
)
from bench.tiers import StoreFloor, floor_rows  # noqa: E402
from kvtier.config import StoreConfig, parse_bytes  # noqa: E402
from kvtier.hashing import KeyContext, block_hashes_for  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.types import KVSpec  # noqa: E402

NAME = "transfers"
SPEC = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
NAMESPACE = KeyContext(model_id="kvtier-bench", dtype="bfloat16", block_size=16).namespace()


def _store(root: Path, num_blocks: int, threads: int) -> TieredStore:
    config = StoreConfig(
        gpu_bytes=0, cpu_bytes=num_blocks * SPEC.block_nbytes, disk_bytes=4 * num_blocks * SPEC.block_nbytes,
        block_size=16, data_dir=root, num_io_threads=threads, flush_on_close=False,
    )
    return TieredStore(SPEC, config, NAMESPACE, device="cpu")


def disk_rows(root: Path, total_bytes: int, repeats: int, threads: int, warnings: list[str]) -> list[Row]:
    """The prefetch, spill and store rows; a kvtier row faster than its floor appends a line to ``warnings``."""
    n = total_bytes // SPEC.block_nbytes
    hashes = block_hashes_for(list(range(n * 16)), NAMESPACE, 16)
    blocks = torch.randn((n, *SPEC.block_shape)).to(SPEC.dtype)
    store = _store(root / "kv", n, threads)
    cpu = store.top
    store.store(hashes, blocks)
    store.flush()

    def forget_cpu() -> None:  # blocks only on DISK
        cpu.clear()

    spill_hashes = block_hashes_for(list(range(10**6, 10**6 + n * 16)), NAMESPACE, 16)

    def fill_slab() -> None:  # the slab full of blocks held nowhere else
        cpu.clear()
        store.disk.remove(hashes + spill_hashes)
        store.store(hashes, blocks)

    def spill() -> None:  # evict the whole slab: every block spills to DISK
        with store.residency.lock:
            store.placement.make_room(0, n)

    def store_into_full() -> None:  # n new blocks: every old one is evicted and spills to DISK
        assert store.store(spill_hashes, blocks) == n

    src, dst = torch.empty(n * SPEC.block_nbytes, dtype=torch.uint8), torch.empty(n * SPEC.block_nbytes, dtype=torch.uint8)
    src.copy_(blocks.view(torch.uint8).reshape(-1))
    raw = prime_raw_file(root / "raw.bin", blocks, 32)

    def prefetch() -> None:
        result = store.prefetch(hashes).wait()
        assert len(result.block_ids) == n, "a block did not come back"
        result.lease.release()

    read, memcpy = measure([Case(prefetch, before=forget_cpu), Case(lambda: dst.copy_(src))], repeats)
    assert torch.equal(cpu.tensor[cpu.block_id(hashes[7])].view(torch.uint8).reshape(-1), src[7 * SPEC.block_nbytes : 8 * SPEC.block_nbytes])
    floors = [StoreFloor(root / "floor-spill.bin", blocks, copy_in=False), StoreFloor(root / "floor-store.bin", blocks)]
    spilled, stored, write, spill_floor, store_floor = measure(
        [Case(spill, before=fill_slab), Case(store_into_full, before=fill_slab), Case(lambda: raw_write(raw, blocks, 32)),
         Case(floors[0].run), Case(floors[1].run)],
        repeats, warmup=disk_warmup_rounds(store.disk, 2 * n * SPEC.block_nbytes),  # LMDB's map primed as the raw file
    )
    assert all(h in store.disk for h in hashes), "a spilled block is not on DISK"
    store.close()
    for floor in floors:
        try:
            floor.check()
        finally:
            floor.close()
    nbytes = n * SPEC.block_nbytes
    gbs = {name: t.throughput(nbytes, "best") for name, t in
           [("spill", spilled), ("store", stored), ("raw", write), ("spill floor", spill_floor), ("store floor", store_floor)]}
    spill_rows, spill_warning = floor_rows(f"  floor of that spill: {floors[0].what}", "  CPU -> DISK spill vs its floor",
                                           gbs["spill"], gbs["spill floor"], gbs["raw"])
    store_rows, store_warning = floor_rows(f"  floor of that store: {floors[1].what}",
                                           "  store() into a full CPU slab vs its floor", gbs["store"], gbs["store floor"],
                                           gbs["raw"])
    warnings.extend(w for w in (spill_warning, store_warning) if w)
    return [
        Row(f"DISK -> CPU prefetch, {threads} I/O threads", read.throughput(nbytes, "best"), "GB/s",
            memcpy.throughput(nbytes, "best"), "memcpy (torch copy_)"),
        Row("CPU -> DISK spill: evict a full CPU slab", gbs["spill"], "GB/s", gbs["raw"], RAW_WRITE_BASELINE),
        *spill_rows,
        Row("store() into a full CPU slab (copy in + spill)", gbs["store"], "GB/s", gbs["raw"], RAW_WRITE_BASELINE),
        *store_rows,
    ]


def overlap_rows(root: Path, busy_s: float) -> tuple[list[Row], list[tuple[str, float]]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.connectors.hf import HFConnector

    torch.manual_seed(0)
    cfg = LlamaConfig(  # SmolLM2-135M's architecture, random weights
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    history = torch.randint(0, 49152, (1, 2048))
    prompt = torch.cat([history, torch.randint(0, 49152, (1, 64))], dim=1)
    config = StoreConfig(gpu_bytes="256MiB", cpu_bytes="256MiB", disk_bytes="1GiB", data_dir=root / "overlap")

    def connector() -> HFConnector:
        return HFConnector.from_model(model, config, model_id="smollm2-arch-random")

    first = connector()
    with torch.inference_mode():
        out = model(history, use_cache=True)
    first.after_request(history[0], getattr(out, "cache", None) or out.past_key_values)
    first.close()

    def request(prefetch: bool, warm: HFConnector | None = None) -> tuple[float, dict[str, float]]:
        kv = warm or connector()  # a fresh store: the history is on DISK only
        marks = {"arrival": time.perf_counter()}
        ticket = kv.prefetch(prompt) if prefetch else None
        marks["prefetch submitted"] = time.perf_counter()
        time.sleep(busy_s)  # the engine is busy with other requests
        marks["engine turns to request"] = time.perf_counter()
        plan = kv.before_prefill(prompt, ticket)
        marks["prefix loaded"] = time.perf_counter()
        with torch.inference_mode():
            logits = model(prompt[:, plan.num_cached_tokens :], **plan.generate_kwargs()).logits
        logits[0, -1].argmax().item()
        marks["first token"] = time.perf_counter()
        if ticket is not None:
            marks["DISK reads done"] = marks["arrival"] + ticket.handle.read_seconds
        assert plan.num_cached_tokens == 2048, plan.num_cached_tokens
        if warm is None:
            kv.close()
        return marks["first token"] - marks["engine turns to request"], marks

    def median_of(runs: list[tuple[float, dict[str, float]]]) -> tuple[float, float, dict[str, float]]:
        runs = sorted(runs, key=lambda r: r[0])
        ttft, marks = runs[len(runs) // 2]
        return ttft, marks["prefix loaded"] - marks["engine turns to request"], marks

    request(False)  # warm-up: first-call overheads
    ttft_plain, load_plain, _ = median_of([request(False) for _ in range(5)])
    ttft_prefetch, load_prefetch, marks = median_of([request(True) for _ in range(5)])
    warm = connector()
    request(False, warm)  # loads into memory
    ttft_memory, load_memory, _ = median_of([request(False, warm) for _ in range(5)])
    warm.close()
    ms = 1e3
    rows = [
        Row("prefix load in TTFT, DISK hit, no prefetch", load_plain * ms, "ms", load_memory * ms, "history in memory"),
        Row("prefix load in TTFT, DISK hit, prefetch at arrival", load_prefetch * ms, "ms", load_memory * ms, "history in memory"),
        Row("TTFT, DISK hit, no prefetch", ttft_plain * ms, "ms", ttft_memory * ms, "history in memory"),
        Row("TTFT, DISK hit, prefetch at arrival", ttft_prefetch * ms, "ms", ttft_memory * ms, "history in memory"),
    ]
    t0 = marks["arrival"]
    timeline = sorted(((name, (t - t0) * 1e3) for name, t in marks.items()), key=lambda x: x[1])
    return rows, timeline


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--total-bytes", default="1GiB", help="bytes moved per measurement (default 1GiB)")
    parser.add_argument("--io-threads", type=int, default=2, help="I/O threads of the store (default 2)")
    parser.add_argument("--busy-ms", type=float, default=300.0, help="engine busy step before prefill (default 300)")
    parser.add_argument("--dir", default=None, help="directory for LMDB and the raw file (default: a temp dir)")
    parser.add_argument("--skip-overlap", action="store_true", help="only the throughput rows")
    args = parser.parse_args()
    apply_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir or os.path.dirname(os.getcwd())))
    try:
        warnings: list[str] = []
        rows = disk_rows(root, parse_bytes(args.total_bytes), args.repeats, args.io_threads, warnings)
        timeline: list[tuple[str, float]] = []
        if not args.skip_overlap:
            more, timeline = overlap_rows(root, args.busy_ms / 1e3)
            rows += more
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if timeline:
        print("Prefetch timeline (ms from the request's arrival):")
        for name, ms in timeline:
            print(f"  {ms:8.1f}  {name}")
    print_table("kvtier transfers (CPU)", rows, footnote="\n".join([RAW_WRITE_NOTE, *warnings]))
    if args.json:
        write_json(args.json, NAME, rows)
    if args.plot:
        write_plot(args.plot, NAME, rows)


if __name__ == "__main__":
    main()
