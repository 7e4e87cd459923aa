"""kvtier on a GPU in one command: ordering tests, H2D/D2H and gather bandwidth, TTFT; a table last.

    python bench/gpu.py [--out DIR] [--quick] [--device cuda|cpu] [--budget-s 400]

Steps (every GB/s row beside a baseline measured in the same run; decimal GB/s, best of
``repeats`` after one warm-up, :func:`bench.common.measure` with ``torch.cuda.synchronize``):

1. tests: ``pytest tests/gpu tests/unit/kernels -m gpu`` in a subprocess (cases G1, G2, per-layer
   prefetch, the Triton kernels compiled); pass/fail counts become rows.
2. H2D / D2H on 2 MiB blocks (Llama-3-8B shape), 1 GiB per measurement, requests of 32 blocks:
   ``TieredStore.load`` of blocks held only in the CPU slab (promotion: the engine's per-layer
   CPU->GPU job on its side stream); the same copies as engine jobs with per-layer events and
   as whole blocks (where a gap comes from); GPU->CPU through the store's eviction spill and
   as an engine job. Baseline: ``copy_`` between a pinned host tensor and a device tensor of
   the same bytes, in the same 32-block chunks.
3. gather: ``kvtier.kernels.gather_blocks_to_contiguous`` of 1 GiB of scattered pool blocks into
   per-layer HF caches, Triton (``KVTIER_KERNELS=triton``) vs the torch reference (index_select,
   ``KVTIER_KERNELS=torch``) vs a device-to-device ``copy_`` of the same bytes; and the
   connector's per-layer ``gather_blocks_to_layers``.
4. TTFT on a random-weight LlamaForCausalLM with Llama-3.1-8B's exact config (bf16, sdpa,
   ``logits_to_keep=1``) at 8k and 32k cached tokens + 256 new ones: a full prefill (no kvtier)
   vs kvtier (history stored once with ``HFConnector.after_request``; ``before_prefill`` +
   suffix prefill) with the history in the GPU pool, and evicted to the CPU slab. Memory: the
   model is 15 GiB, 32k tokens of its K/V 4 GiB (128 KiB per token); all fits in 141 GB.

``--quick``: 256 MiB transfers, a model of 8 of the 8B's layers, 8k cached tokens only.
``--device cpu``: a dry run with tiny sizes through every code path that does not need CUDA
(GPU pools in host memory, the Triton interpreter, a tiny Llama; tests/gpu run on the CPU via
``KVTIER_GPU_TESTS_ON_CPU=1``): it checks this script, not the GPU. Steps 2-4 need no lmdb
(``disk_bytes=0``). A step that fails is reported and the next one runs; steps that would start
after ``--budget-s`` are skipped with a note.

Outputs under ``--out`` (default ``$OUT``, else ./gpu-results): ``gpu.json`` (``{"bench": "gpu",
"rows": [...]}``), ``summary.md``, ``gpu.log``, ``pytest.log``, ``pytest.xml``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import Case, Row, measure, print_table, write_json, write_plot  # noqa: E402
from bench.tiers import NAMESPACE, SPEC, copy_chunks, make_blocks  # noqa: E402
from kvtier.config import StoreConfig  # noqa: E402
from kvtier.hashing import block_hashes_for  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.transfer.engine import TransferJob  # noqa: E402
from kvtier.transfer.handlers import PoolCopyHandler  # noqa: E402
from kvtier.types import KVSpec, Medium  # noqa: E402

NAME = "gpu"
log = logging.getLogger("bench.gpu")

LLAMA_3_1_8B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
    tie_word_embeddings=False, rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)
TINY_LLAMA: dict[str, Any] = dict(
    LLAMA_3_1_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    rope_scaling=dict(LLAMA_3_1_8B["rope_scaling"], original_max_position_embeddings=1024),
)
TARGETS = (  # (metric prefix, minimum ratio to its baseline), from the issue
    ("gather: Triton gather_blocks_to_contiguous", 0.7),
    ("H2D: store.load()", 0.8),
)


@dataclass(frozen=True)
class Plan:
    """Sizes of one run."""

    transfer_blocks: int = 512  # step 2, 2 MiB blocks per measurement (1 GiB)
    request_blocks: int = 32
    repeats: int = 5
    gather_spec: KVSpec = SPEC
    gather_blocks: int = 512
    gather_iters: int = 5  # gathers per timed sample (amortises the host sync)
    model: dict[str, Any] = field(default_factory=lambda: dict(LLAMA_3_1_8B))
    model_dtype: torch.dtype = torch.bfloat16
    cached_tokens: tuple[int, ...] = (8192, 32768)
    suffix_tokens: int = 256
    ttft_repeats: int = 3
    pytest_timeout_s: int = 200


def make_plan(device: str, quick: bool) -> Plan:
    if device == "cpu":
        return Plan(
            transfer_blocks=8, request_blocks=4, repeats=2,
            gather_spec=KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16),
            gather_blocks=4, gather_iters=1, model=dict(TINY_LLAMA), cached_tokens=(64, 256),
            suffix_tokens=16, ttft_repeats=2, pytest_timeout_s=300,
        )
    if quick:
        return Plan(
            transfer_blocks=128, repeats=3, gather_blocks=128,
            model=dict(LLAMA_3_1_8B, num_hidden_layers=8), cached_tokens=(8192,), ttft_repeats=2,
            pytest_timeout_s=150,
        )
    return Plan()


@dataclass
class Run:
    """What every step needs: sizes, device, where files go, the clock."""

    plan: Plan
    device: torch.device
    out: Path
    work_dir: Path
    budget_s: float
    started: float = field(default_factory=time.perf_counter)
    notes: list[str] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> Callable[[], None] | None:
        return torch.cuda.synchronize if self.cuda else None

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self) -> bool:
        return self.elapsed_s() > self.budget_s

    def note(self, text: str) -> None:
        log.info("note: %s", text)
        self.notes.append(text)

    def store(self, spec: KVSpec, gpu_blocks: int, cpu_blocks: int, tag: str) -> TieredStore:
        """A store without DISK (no lmdb needed), its GPU pool on the run's device."""
        config = StoreConfig(
            gpu_bytes=gpu_blocks * spec.block_nbytes, cpu_bytes=cpu_blocks * spec.block_nbytes, disk_bytes=0,
            block_size=spec.block_size, data_dir=self.work_dir / tag, flush_on_close=False,
        )
        return TieredStore(spec, config, NAMESPACE, device=self.device, emulate_gpu=True)

    def gbps_row(self, metric: str, value: Case, baseline: Case, baseline_name: str, nbytes: int) -> Row:
        """Time ``value`` and ``baseline`` interleaved into one GB/s row (best of repeats)."""
        base, val = measure([baseline, value], self.plan.repeats, sync=self.sync())
        row = Row(metric, val.throughput(nbytes, "best"), "GB/s", base.throughput(nbytes, "best"), baseline_name)
        log.info("%s: %.2f GB/s vs %.2f GB/s (%s)", metric, row.value, row.baseline, baseline_name)
        return row


# -- step 1: tests -----------------------------------------------------------------------------
def step_tests(run: Run) -> list[Row]:
    """``pytest tests/gpu tests/unit/kernels -m gpu`` in a subprocess; counts from its JUnit XML."""
    xml_path, log_path = run.out / "pytest.xml", run.out / "pytest.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if not run.cuda:
        env["KVTIER_GPU_TESTS_ON_CPU"] = "1"  # tests/gpu run their steps on the CPU
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "tests/unit/kernels", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml_path}"]
    timeout_s = max(30.0, min(run.plan.pytest_timeout_s, run.budget_s - run.elapsed_s() - 60))
    log.info("step 1: %s (timeout %.0f s)", " ".join(cmd), timeout_s)
    with open(log_path, "w") as out:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
            run.note(f"tests: pytest did not finish in {timeout_s:.0f} s and was killed (see pytest.log)")
    counts = _junit_counts(xml_path)
    if counts is None:
        run.note(f"tests: no JUnit XML (pytest exit code {rc}); see pytest.log")
        return [Row("tests: pytest -m gpu exit code", float(-1 if rc is None else rc), "code")]
    total, failed, skipped = counts
    passed = total - failed - skipped
    if rc not in (0, None) and not failed:
        run.note(f"tests: pytest exit code {rc} without a failed test (collection error?); see pytest.log")
    return [
        Row("tests: passed (pytest tests/gpu tests/unit/kernels -m gpu)", float(passed), "tests", float(total - skipped), "tests run"),
        Row("tests: failed or errors", float(failed), "tests"),
        Row("tests: skipped", float(skipped), "tests"),
    ]


def _junit_counts(path: Path) -> tuple[int, int, int] | None:
    """``(tests, failures + errors, skipped)`` summed over the suites, or ``None``."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return total, failed, skipped


# -- step 2: H2D / D2H -------------------------------------------------------------------------
def evict_gpu(store: TieredStore) -> None:
    """Evict every block of the GPU pool (each spills to the CPU slab unless already there)."""
    with store.residency.lock:
        store.placement.make_room(0, store.top.num_blocks)


def start_jobs(start: Callable[[TransferJob], Any], src: Medium, dst: Medium, hashes: list, src_ids: list[int],
               dst_ids: list[int], chunk: int) -> list:
    """Start one job per ``chunk`` blocks (all before any wait); returns what ``start`` returned."""
    return [
        start(TransferJob(src, dst, hashes[i : i + chunk], src_ids=src_ids[i : i + chunk], dst_ids=dst_ids[i : i + chunk]))
        for i in range(0, len(hashes), chunk)
    ]


def step_transfers(run: Run) -> list[Row]:
    n, R = run.plan.transfer_blocks, run.plan.request_blocks
    nbytes = n * SPEC.block_nbytes
    store = run.store(SPEC, gpu_blocks=n, cpu_blocks=n, tag="transfers")
    try:
        src = make_blocks(n, run.device)  # [n, *SPEC.block_shape] on the device
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=run.cuda)  # the baseline's two ends
        dev = torch.empty_like(src)
        host.copy_(src)
        dev.zero_()
        hashes = block_hashes_for(list(range(n * SPEC.block_size)), NAMESPACE, SPEC.block_size)
        assert store.store(hashes, src) == n, "the GPU pool did not take every block"
        evict_gpu(store)  # every block now only in the CPU slab
        h2d, d2h = Case(lambda: copy_chunks(dev, host, R)), Case(lambda: copy_chunks(host, dev, R))
        h2d_name, d2h_name = ("raw pinned copy_ H2D", "raw pinned copy_ D2H") if run.cuda else ("host copy_", "host copy_")

        def load_all() -> None:
            for i in range(0, n, R):
                result = store.load(hashes[i : i + R])
                assert len(result.block_ids) == len(hashes[i : i + R]) and set(result.sources) == {Medium.CPU}
                result.lease.release()

        def prefetch_all() -> None:  # every request in flight before the first wait
            handles = [store.prefetch(hashes[i : i + R]) for i in range(0, n, R)]
            for handle in handles:
                result = handle.wait()
                assert len(result.block_ids) == handle.num_blocks == len(result.sources)
                result.lease.release()

        evict = lambda: evict_gpu(store)  # noqa: E731
        rows = [
            run.gbps_row(f"H2D: store.load(), CPU-slab hits, requests of {R}", Case(load_all, evict), h2d, h2d_name, nbytes),
            run.gbps_row(f"H2D: store.prefetch() x {-(-n // R)} in flight, then wait()", Case(prefetch_all, evict), h2d,
                         h2d_name, nbytes),
        ]
        _check_loaded(store, hashes, src)
        rows += _engine_h2d_rows(run, store, hashes, src, h2d, h2d_name)
        rows += _d2h_rows(run, store, hashes, src, d2h, d2h_name)
        return rows
    finally:
        store.close()


def _check_loaded(store: TieredStore, hashes: list, src: torch.Tensor) -> None:
    for i in sorted({0, len(hashes) // 2, len(hashes) - 1}):
        result = store.load([hashes[i]])
        with result.lease:
            if not torch.equal(store.top.tensor[result.block_ids[0]], src[i]):
                raise RuntimeError(f"block {i} loaded through the store differs from the block stored")


def _engine_h2d_rows(run: Run, store: TieredStore, hashes: list, src: torch.Tensor, baseline: Case, name: str) -> list[Row]:
    """CPU -> GPU jobs of the transfer engine's handler into the free GPU pool (index untouched):
    per-layer events (what loads use) and whole blocks, one job per request, all started
    before the first wait."""
    n, R = len(hashes), run.plan.request_blocks
    gpu, cpu = store.pool(Medium.GPU), store.pool(Medium.CPU)
    cpu_ids, gpu_ids = [cpu.block_id(h) for h in hashes], list(range(n))
    rows = []
    for per_layer in (True, False):
        handler = PoolCopyHandler(cpu, gpu, per_layer=per_layer)

        def copy(handler: PoolCopyHandler = handler) -> None:
            for pending in start_jobs(handler.start, Medium.CPU, Medium.GPU, hashes, cpu_ids, gpu_ids, R):
                assert pending.result().success

        what = "per-layer events (as loads)" if per_layer else "whole blocks"
        metric = f"H2D: PoolCopyHandler CPU->GPU jobs, {what}"
        rows.append(run.gbps_row(metric, Case(copy, lambda: evict_gpu(store)), baseline, name, n * SPEC.block_nbytes))
        if not torch.equal(gpu.tensor[n - 1], src[n - 1]):
            raise RuntimeError(f"PoolCopyHandler CPU->GPU ({what}) copied the wrong bytes")
    return rows


def _d2h_rows(run: Run, store: TieredStore, hashes: list, src: torch.Tensor, baseline: Case, name: str) -> list[Row]:
    """GPU -> CPU: the store's eviction spill of a full GPU pool, and the engine handler's jobs."""
    n, R = len(hashes), run.plan.request_blocks
    gpu, cpu = store.pool(Medium.GPU), store.pool(Medium.CPU)

    def gpu_only() -> None:  # every block in the GPU pool, none in the CPU slab
        cpu.clear()
        assert store.store(hashes, src) == n

    rows = [run.gbps_row("D2H: store eviction spill (GPU pool -> CPU slab)", Case(lambda: evict_gpu(store), gpu_only),
                         baseline, name, n * SPEC.block_nbytes)]
    if not torch.equal(cpu.tensor[cpu.block_id(hashes[-1])], src[-1].cpu()):
        raise RuntimeError("a spilled block differs from the block stored")
    handler = PoolCopyHandler(gpu, cpu)

    def offload() -> None:
        gpu_ids = [gpu.block_id(h) for h in hashes]
        for pending in start_jobs(handler.start, Medium.GPU, Medium.CPU, hashes, gpu_ids, list(range(n)), R):
            assert pending.result().success

    rows.append(run.gbps_row("D2H: PoolCopyHandler GPU->CPU jobs (side stream)", Case(offload, gpu_only), baseline, name,
                             n * SPEC.block_nbytes))
    if not torch.equal(cpu.tensor[n - 1], gpu.tensor[gpu.block_id(hashes[-1])].cpu()):
        raise RuntimeError("PoolCopyHandler GPU->CPU copied the wrong bytes")
    return rows


# -- step 3: gather ----------------------------------------------------------------------------
@contextlib.contextmanager
def kernels_mode(mode: str) -> Iterator[None]:
    """``KVTIER_KERNELS=mode`` for the block (read by kvtier.kernels on every call)."""
    before = os.environ.get("KVTIER_KERNELS")
    os.environ["KVTIER_KERNELS"] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("KVTIER_KERNELS", None)
        else:
            os.environ["KVTIER_KERNELS"] = before


def step_gather(run: Run) -> list[Row]:
    from kvtier import kernels

    p, spec, n = run.plan, run.plan.gather_spec, run.plan.gather_blocks
    num_layers, _, block_size, num_kv_heads, head_dim = spec.block_shape
    torch.manual_seed(0)
    pool = torch.randn((2 * n, *spec.block_shape), dtype=spec.dtype, device=run.device)
    ids = torch.randperm(2 * n)[:n].to(run.device)  # scattered blocks, in request order
    shape = (1, num_kv_heads, n * block_size, head_dim)
    keys = [torch.empty(shape, dtype=spec.dtype, device=run.device) for _ in range(num_layers)]
    values = [torch.empty(shape, dtype=spec.dtype, device=run.device) for _ in range(num_layers)]
    src = torch.randn(n * spec.block_numel, dtype=spec.dtype, device=run.device)
    dst = torch.empty_like(src)
    with kernels_mode("triton"):
        if not kernels.use_triton(pool):
            raise RuntimeError("KVTIER_KERNELS=triton does not run Triton on this pool (TRITON_INTERPRET set on CUDA?)")

    def gather(mode: str) -> Callable[[], None]:
        def run_gathers() -> None:
            with kernels_mode(mode):
                for _ in range(p.gather_iters):
                    kernels.gather_blocks_to_contiguous(pool, ids, keys, values, check_ids=False)
        return run_gathers

    def per_layer() -> None:  # what HFConnector.before_prefill does
        with kernels_mode("triton"):
            for _ in range(p.gather_iters):
                for layer in range(num_layers):
                    kernels.gather_blocks_to_layers(pool[:, layer : layer + 1], ids, check_ids=False)

    def d2d() -> None:
        for _ in range(p.gather_iters):
            dst.copy_(src)

    copy_t, triton_t, torch_t, layers_t = measure([Case(d2d), Case(gather("triton")), Case(gather("torch")), Case(per_layer)],
                                                  p.repeats, sync=run.sync())
    _check_gather(pool, ids, keys, values)
    nbytes = p.gather_iters * n * spec.block_nbytes
    copy_gbps, torch_gbps = copy_t.throughput(nbytes, "best"), torch_t.throughput(nbytes, "best")
    name = "D2D copy_ of the same bytes" if run.cuda else "host copy_ of the same bytes"
    label = f"{n} blocks of {spec.block_nbytes >> 10} KiB"
    return [
        Row(f"gather: Triton gather_blocks_to_contiguous, {label}", triton_t.throughput(nbytes, "best"), "GB/s", copy_gbps, name),
        Row("gather: torch reference (index_select)", torch_gbps, "GB/s", copy_gbps, name),
        Row("gather: Triton vs torch reference", triton_t.throughput(nbytes, "best"), "GB/s", torch_gbps, "torch reference"),
        Row("gather: connector path (per-layer gather_blocks_to_layers)", layers_t.throughput(nbytes, "best"), "GB/s",
            copy_gbps, name),
    ]


def _check_gather(pool: torch.Tensor, ids: torch.Tensor, keys: list, values: list) -> None:
    """The Triton gather equals the torch reference bit for bit (outputs poisoned first)."""
    from kvtier import kernels

    outputs = []
    for mode in ("triton", "torch"):
        for t in (*keys, *values):
            t.fill_(1e4)
        with kernels_mode(mode):
            kernels.gather_blocks_to_contiguous(pool, ids, keys, values)
        outputs.append([t.clone() for t in (*keys, *values)])
    if not all(torch.equal(a, b) for a, b in zip(*outputs)):
        raise RuntimeError("the Triton gather differs from the torch reference")


def fmt_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


# -- step 4: TTFT ------------------------------------------------------------------------------
def build_model(run: Run) -> torch.nn.Module:
    """A random-weight LlamaForCausalLM with ``plan.model``'s config, built on the device."""
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM

    fields_ = dict(run.plan.model)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers 5.x
        fields_["rope_parameters"] = dict(fields_.pop("rope_scaling"), rope_theta=fields_.pop("rope_theta"))
    cfg = LlamaConfig(**fields_, attn_implementation="sdpa")
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(run.plan.model_dtype)
    try:
        with torch.device(run.device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def output_cache(out: Any) -> Any:
    for name in ("cache", "past_key_values"):  # transformers >= 5.2x names it cache
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    raise RuntimeError("the model's output holds no cache")


def step_ttft(run: Run) -> list[Row]:
    from kvtier.connectors.hf import HFConnector, kv_spec_for

    p = run.plan
    started = time.perf_counter()
    if run.cuda:
        torch.cuda.reset_peak_memory_stats()
    model = build_model(run)
    spec = kv_spec_for(model, 16)
    num_blocks = sum(c // spec.block_size for c in p.cached_tokens) + 8
    config = StoreConfig(
        gpu_bytes=num_blocks * spec.block_nbytes, cpu_bytes=num_blocks * spec.block_nbytes, disk_bytes=0,
        block_size=spec.block_size, data_dir=run.work_dir / "ttft", flush_on_close=False,
    )
    kv = HFConnector.from_model(model, config, model_id="llama-3.1-8b-architecture", model_revision="random-init-seed-0")
    params = sum(t.numel() for t in model.parameters())
    run.note(
        f"TTFT memory: model {fmt_bytes(params * model.dtype.itemsize)} ({params / 1e6:,.0f} M params, {model.dtype}, "
        f"built in {time.perf_counter() - started:.1f} s); K/V {fmt_bytes(spec.bytes_per_token)} per token, "
        f"{max(p.cached_tokens)} cached tokens = {fmt_bytes(max(p.cached_tokens) * spec.bytes_per_token)}; "
        f"GPU pool and CPU slab {fmt_bytes(config.gpu_bytes)} each"
    )
    rows: list[Row] = []
    try:
        for cached in p.cached_tokens:
            if run.out_of_time():
                run.note(f"TTFT at {cached} cached tokens skipped: past the {run.budget_s:.0f} s budget")
                continue
            try:
                rows += ttft_rows(run, model, kv, cached)
            except Exception as exc:  # an OOM or a too-slow 32k prefill: report it, keep the other rows
                log.exception("TTFT at %d cached tokens failed", cached)
                run.note(f"TTFT at {cached} cached tokens failed: {type(exc).__name__}: {str(exc)[:200]}")
            gc.collect()  # after the except block, which kept the failed frames (and their tensors) alive
            if run.cuda:
                torch.cuda.empty_cache()
    finally:
        if run.cuda:
            run.note(f"TTFT peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        kv.close()
    return rows


def ttft_rows(run: Run, model: torch.nn.Module, kv: Any, cached: int) -> list[Row]:
    """Full prefill vs kvtier (GPU-pool hit, CPU-slab hit) for ``cached`` + suffix tokens."""
    p, device = run.plan, run.device
    g = torch.Generator().manual_seed(cached)
    prompt = torch.randint(0, model.config.vocab_size, (1, cached + p.suffix_tokens), generator=g).to(device)

    def full() -> Any:
        with torch.inference_mode():
            out = model(prompt, use_cache=True, logits_to_keep=1)
        out.logits[0, -1].argmax().item()
        return out

    started = time.perf_counter()
    out = full()  # also the history's K/V, stored once as after an earlier turn
    first_s = time.perf_counter() - started
    assert kv.after_request(prompt[0, :cached], output_cache(out)) == cached // kv.block_size
    del out

    load_s: dict[Medium, list[float]] = {Medium.GPU: [], Medium.CPU: []}

    def with_kvtier(medium: Medium) -> Callable[[], None]:
        def request() -> None:
            started = time.perf_counter()
            plan = kv.before_prefill(prompt)  # returns once the prefix is in; its gathers may be queued
            load_s[medium].append(time.perf_counter() - started)
            assert plan.num_cached_tokens == cached and set(plan.sources) == {medium}, (plan.num_cached_tokens, set(plan.sources))
            with torch.inference_mode():
                out = model(prompt[:, cached:], **plan.generate_kwargs(), use_cache=True, logits_to_keep=1)
            out.logits[0, -1].argmax().item()
        return request

    remaining_s = run.budget_s - run.elapsed_s()
    repeats = max(1, min(p.ttft_repeats, int(remaining_s / (3 * first_s + 1e-9)) - 1))
    if repeats < p.ttft_repeats:
        run.note(f"TTFT at {cached} cached tokens: {repeats} repeats (a full prefill took {first_s:.1f} s)")
    cases = [Case(full), Case(with_kvtier(Medium.GPU)), Case(with_kvtier(Medium.CPU), lambda: evict_gpu(kv.store))]
    full_t, gpu_t, cpu_t = measure(cases, repeats, sync=run.sync())
    ms, base = 1e3, full_t.median_s * 1e3
    cpu_load_ms = statistics.median(load_s[Medium.CPU][1:]) * ms  # [0] is the warm-up
    label = f"TTFT {f'{cached // 1024}k' if cached >= 1024 else cached} cached + {p.suffix_tokens} new"
    log.info("%s: full %.1f ms, GPU hit %.1f ms, CPU hit %.1f ms (before_prefill %.1f ms)", label, base,
             gpu_t.median_s * ms, cpu_t.median_s * ms, cpu_load_ms)
    return [
        Row(f"{label}: kvtier, GPU-pool hit", gpu_t.median_s * ms, "ms", base, "full prefill, no kvtier"),
        Row(f"{label}: kvtier, CPU-slab hit (H2D)", cpu_t.median_s * ms, "ms", base, "full prefill, no kvtier"),
        Row(f"{label}: before_prefill part of the CPU-slab hit", cpu_load_ms, "ms"),
    ]


# -- report ------------------------------------------------------------------------------------
def target_lines(rows: list[Row], cuda: bool) -> list[str]:
    lines = []
    for prefix, minimum in TARGETS:
        row = next((r for r in rows if r.metric.startswith(prefix)), None)
        if row is None or row.ratio is None:
            lines.append(f"target {prefix} >= {minimum}x of its baseline: not measured")
            continue
        verdict = ("PASS" if row.ratio >= minimum else "FAIL") if cuda else "n/a (CPU dry run)"
        lines.append(f"target {prefix} >= {minimum}x of {row.baseline_name}: {row.ratio:.2f}x {verdict}")
    failed = next((r for r in rows if r.metric == "tests: failed or errors"), None)
    if failed is not None:
        lines.append(f"tests: {'PASS' if failed.value == 0 else 'FAIL'} ({int(failed.value)} failed or errors)")
    return lines


def environment(run: Run) -> dict[str, str]:
    env = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "python": platform.python_version(),
           "torch": torch.__version__, "command": " ".join([Path(sys.executable).name, *sys.argv])}
    env["device"] = torch.cuda.get_device_name(run.device) if run.cuda else f"CPU dry run ({platform.machine()})"
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            env[name] = f"unavailable ({type(exc).__name__})"
    return env


def write_summary(run: Run, rows: list[Row], checks: list[str], step_s: dict[str, float]) -> None:
    env = environment(run)
    lines = ["# kvtier GPU run", ""] + [f"- {k}: {v}" for k, v in env.items()]
    lines.append("- elapsed: " + ", ".join(f"{k} {v:.0f} s" for k, v in step_s.items()) + f"; total {run.elapsed_s():.0f} s")
    lines += ["", "## Targets", ""] + [f"- {c}" for c in checks]
    lines += ["", "## Rows", "", "| metric | value | unit | baseline | ratio | baseline is |",
              "| --- | ---: | --- | ---: | ---: | --- |"]
    for r in rows:
        base = "-" if r.baseline is None else f"{r.baseline:.2f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        lines.append(f"| {r.metric} | {r.value:.2f} | {r.unit} | {base} | {ratio} | {r.baseline_name} |")
    lines += ["", "## Notes", ""] + [f"- {n}" for n in run.notes or ["none"]]
    (run.out / "summary.md").write_text("\n".join(lines) + "\n")


STEPS = (  # (name, step, seconds it needs at least, on an H200)
    ("tests", step_tests, 60),
    ("transfers", step_transfers, 20),
    ("gather", step_gather, 15),
    ("ttft", step_ttft, 60),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="results directory (default $OUT, else ./gpu-results)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows here (always in --out/gpu.json)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PATH",
                        help="also draw the rows as a PNG here (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (256 MiB transfers, 8-layer model, 8k only)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of this script")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="no step starts after this many seconds (default 400)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = (args.out or Path(os.environ.get("OUT") or "gpu-results")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[logging.FileHandler(out / "gpu.log", mode="w"), logging.StreamHandler(sys.stderr)])
    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("no CUDA device: run on a GPU machine, or pass --device cpu for a dry run")
        return 2
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvtier.kernels.triton_kv is imported
    elif os.environ.get("TRITON_INTERPRET"):
        log.warning("TRITON_INTERPRET is set: the Triton kernels will not compile for the GPU")
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-gpu-"))
    run = Run(make_plan(args.device, args.quick), torch.device(args.device), out, work_dir, args.budget_s)
    rows: list[Row] = []
    step_s: dict[str, float] = {}
    try:
        for name, step, min_left_s in STEPS:
            if run.budget_s - run.elapsed_s() < min_left_s:
                run.note(f"step {name} skipped: {run.elapsed_s():.0f} s elapsed of a {run.budget_s:.0f} s budget "
                         f"(it needs about {min_left_s} s)")
                continue
            started = time.perf_counter()
            log.info("step %s: start at %.0f s", name, run.elapsed_s())
            try:
                rows += step(run)
            except Exception as exc:  # one broken step must not lose the others' rows
                log.exception("step %s failed", name)
                run.note(f"step {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
            step_s[name] = time.perf_counter() - started
            gc.collect()
            if run.cuda:
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    checks = target_lines(rows, run.cuda)
    write_json(out / "gpu.json", NAME, rows)
    if args.json:
        write_json(args.json, NAME, rows)
    if args.plot:
        write_plot(args.plot, NAME, rows)
    write_summary(run, rows, checks, step_s)
    env = environment(run)
    title = (f"kvtier GPU bench on {env['device']}: torch {env['torch']}, triton {env['triton']}, "
             f"{run.elapsed_s():.0f} s; files in {out}")
    print_table(title, rows, footnote="\n".join(checks + run.notes))
    failed = any(c.startswith("tests: FAIL") for c in checks) or any("failed" in n for n in run.notes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
