"""kvtier.metrics: Prometheus counters read from store.stats at scrape time (case M1: each
event counted once), tokens = blocks * block_size, bytes per path, occupancy, latency."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import metrics
from tests.conftest import BLOCK_SIZE, MemoryRemote, chain, random_blocks, tiny_spec

B = BLOCK_SIZE


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, frozenset(labels)): value}`` parsed back from the exposition text."""
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_counters_in_blocks_tokens_and_bytes_follow_a_known_sequence(make_store, namespace):
    spec = tiny_spec()
    store = make_store(gpu_blocks=8)
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="ns")
    hashes = chain(6, spec, namespace)

    assert store.store(hashes[:4], random_blocks(spec, 4)) == 4
    store.lookup(hashes)  # 6 asked, 4 found in GPU
    loaded = store.load(hashes)  # 6 asked, 4 found and loaded; GPU is the top pool: no bytes move
    loaded.lease.release()
    s = scrape(registry)
    assert value(s, "kvtier_lookup_blocks_total", namespace="ns") == 12
    assert value(s, "kvtier_lookup_tokens_total", namespace="ns") == 12 * B
    assert value(s, "kvtier_hit_blocks_total", namespace="ns", tier="GPU") == 8
    assert value(s, "kvtier_hit_tokens_total", namespace="ns", tier="GPU") == 8 * B
    assert value(s, "kvtier_loaded_tokens_total", namespace="ns", tier="GPU") == 4 * B
    assert value(s, "kvtier_stored_tokens_total", namespace="ns", tier="GPU") == 4 * B
    assert value(s, "kvtier_moved_bytes_total", namespace="ns", src="engine", dst="GPU") == 4 * spec.block_nbytes
    assert value(s, "kvtier_used_blocks", namespace="ns", tier="GPU") == 4
    assert value(s, "kvtier_used_bytes", namespace="ns", tier="GPU") == 4 * spec.block_nbytes
    assert value(s, "kvtier_capacity_bytes", namespace="ns", tier="GPU") == 8 * spec.block_nbytes
    assert value(s, "kvtier_block_size_tokens", namespace="ns") == B
    assert value(s, "kvtier_evicted_blocks_total", namespace="ns", tier="GPU") == 0

    for start in (10_000, 20_000):  # two more requests of 4 blocks: the second one evicts 4
        assert store.store(chain(4, spec, namespace, start=start), random_blocks(spec, 4, seed=start)) == 4
    s = scrape(registry)
    assert value(s, "kvtier_evicted_blocks_total", namespace="ns", tier="GPU") == 4
    assert value(s, "kvtier_used_blocks", namespace="ns", tier="GPU") == 8
    # Scraping reads the counters; it never adds to them.
    assert scrape(registry) == s


def test_spills_and_loads_are_counted_per_path(make_store, namespace):
    spec = tiny_spec()
    store = make_store(gpu_blocks=2, cpu_blocks=8)
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="ns")
    hashes = chain(4, spec, namespace)
    assert store.store(hashes, random_blocks(spec, 4)) == 4
    assert store.stats.spilled_blocks["CPU"] >= 2, "a 2-slot GPU pool must spill at least 2 of 4 blocks to CPU"
    loaded = store.load(hashes[:1])  # block 0 lives in the CPU slab now
    assert loaded.sources == ["CPU"]
    loaded.lease.release()
    s = scrape(registry)
    stats = store.stats
    spilled = stats.spilled_blocks["CPU"]
    assert value(s, "kvtier_spilled_blocks_total", namespace="ns", src="GPU", dst="CPU") == spilled
    assert value(s, "kvtier_moved_bytes_total", namespace="ns", src="GPU", dst="CPU") == spilled * spec.block_nbytes
    assert value(s, "kvtier_moved_bytes_total", namespace="ns", src="CPU", dst="GPU") == spec.block_nbytes
    assert value(s, "kvtier_loaded_blocks_total", namespace="ns", tier="CPU") == 1
    assert value(s, "kvtier_evicted_blocks_total", namespace="ns", tier="GPU") == stats.evicted_blocks["GPU"]


def test_corrupt_disk_record_counts_one_load_failure_and_no_load(make_store, namespace):
    spec = tiny_spec()
    store = make_store(gpu_blocks=2, disk_blocks=8)
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="ns")
    hashes = chain(4, spec, namespace)
    store.store(hashes, random_blocks(spec, 4))
    assert hashes[0] in store.disk and hashes[0] not in store.top
    with store.disk.env.begin(write=True) as txn:  # flip one payload byte behind the store's back
        record = bytearray(txn.get(hashes[0]))
        record[-1] ^= 0xFF
        txn.put(hashes[0], bytes(record))
    loaded = store.load(hashes[:1])
    assert loaded.block_ids == []
    loaded.lease.release()
    s = scrape(registry)
    corrupt = [(dict(labels)["tier"], v) for (name, labels), v in s.items()
               if name == "kvtier_load_failures_total" and dict(labels)["reason"] == "corrupt"]
    assert corrupt == [("DISK", 1)]
    assert value(s, "kvtier_loaded_blocks_total", namespace="ns", tier="DISK") == 0
    assert value(s, "kvtier_hit_blocks_total", namespace="ns", tier="DISK") >= 1


def test_latency_histogram_counts_each_operation_once(make_store, namespace):
    spec = tiny_spec()
    store = make_store(gpu_blocks=8)
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="ns")
    hashes = chain(4, spec, namespace)
    store.store(hashes, random_blocks(spec, 4))
    for _ in range(3):
        store.lookup(hashes)
    for _ in range(2):
        store.load(hashes).lease.release()
    s = scrape(registry)
    count = "kvtier_operation_duration_seconds_count"
    assert value(s, count, namespace="ns", op="lookup") == 3
    assert value(s, count, namespace="ns", op="load") == 2
    assert value(s, count, namespace="ns", op="store") == 1
    assert value(s, "kvtier_operation_duration_seconds_sum", namespace="ns", op="lookup") > 0


def test_two_stores_in_one_registry_and_unregister(make_store, namespace):
    spec = tiny_spec()
    a, b = make_store(gpu_blocks=4), make_store(gpu_blocks=4, data_dir=None)
    registry = CollectorRegistry()
    first = metrics.register(a, registry, namespace_label="a")
    assert metrics.register(b, registry, namespace_label="b") is first  # one collector per registry
    with pytest.raises(ValueError, match="already another store"):
        metrics.register(b, registry, namespace_label="a")
    a.lookup(chain(3, spec, namespace))
    s = scrape(registry)
    assert value(s, "kvtier_lookup_tokens_total", namespace="a") == 3 * B
    assert value(s, "kvtier_lookup_tokens_total", namespace="b") == 0
    metrics.unregister(a, registry)
    assert a.observe is None, "unregister must remove the latency hook"
    s = scrape(registry)
    assert all(dict(labels).get("namespace") != "a" for _, labels in s)
    assert value(s, "kvtier_lookup_tokens_total", namespace="b") == 0
    with pytest.raises(ValueError):  # a second kvtier collector in the same registry is refused
        metrics.KvtierMetrics(registry)


def test_a_hook_already_set_is_still_called(make_store, namespace):
    store = make_store(gpu_blocks=4)
    seen: list[str] = []
    store.observe = lambda op, seconds: seen.append(op)
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="ns")
    store.lookup(chain(1, tiny_spec(), namespace))
    assert seen == ["lookup"]
    assert value(scrape(registry), "kvtier_operation_duration_seconds_count", namespace="ns", op="lookup") == 1
    metrics.unregister(store, registry)
    store.lookup(chain(1, tiny_spec(), namespace))
    assert seen == ["lookup", "lookup"]


def test_stores_source_is_read_at_scrape_time(make_store, namespace):
    """The daemon's way: a mapping of namespaces that grows while it runs."""
    stores: dict[str, object] = {}
    registry = CollectorRegistry()
    m = metrics.KvtierMetrics(registry, stores=lambda: stores)
    assert not [k for k in scrape(registry) if k[0] == "kvtier_lookup_tokens_total"]
    store = make_store(gpu_blocks=4)
    stores["late"] = store
    scrape(registry)  # hooks the new store's latency
    store.lookup(chain(2, tiny_spec(), namespace))
    s = scrape(registry)
    assert value(s, "kvtier_lookup_tokens_total", namespace="late") == 2 * B
    assert value(s, "kvtier_operation_duration_seconds_count", namespace="late", op="lookup") == 1
    m.close()
    assert store.observe is None
    assert not [k for k in scrape(registry) if k[0].startswith("kvtier_")]


def test_start_http_server_serves_the_registry(make_store, namespace):
    store = make_store(gpu_blocks=4)
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="ns")
    store.lookup(chain(5, tiny_spec(), namespace))
    server, thread = metrics.start_http_server(0, registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert f'kvtier_lookup_tokens_total{{namespace="ns"}} {5 * B}.0' in text


# -- case M1: count once ------------------------------------------------------------------------
M1_BS = 8  # 1,000-token prompt = 125 blocks; 600 tokens = 75 blocks; 400 = 50; 200 = 25


def _m1_store(make_store, remote=None):
    spec = tiny_spec(block_size=M1_BS)
    return spec, make_store(gpu_blocks=256, spec=spec, remote=remote)


def test_m1_local_hits_counted_once_across_a_retried_schedule(make_store, namespace):
    spec, store = _m1_store(make_store)
    hashes = chain(125, spec, namespace)
    assert store.store(hashes[:75], random_blocks(spec, 75)) == 75
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="m1")
    before = scrape(registry)
    for _ in range(2):  # the request is scheduled twice (a retry): lookup, then load
        assert store.lookup(hashes, request_id="req-1").num_hit_blocks == 75
        store.load(hashes, request_id="req-1").lease.release()
    s = scrape(registry)
    assert value(before, "kvtier_lookup_tokens_total", namespace="m1") == 0
    assert value(s, "kvtier_lookup_tokens_total", namespace="m1") == 1000
    assert value(s, "kvtier_hit_tokens_total", namespace="m1", tier="GPU") == 600
    assert sum(v for (n, _), v in s.items() if n == "kvtier_hit_tokens_total") == 600


def test_m1_remote_queries_and_hits_counted_once(make_store, namespace):
    remote = MemoryRemote()
    spec, store = _m1_store(make_store, remote=remote)
    hashes = chain(125, spec, namespace)
    blocks = random_blocks(spec, 100)
    remote.put(namespace, hashes[75:100], list(blocks[75:100]))  # another engine stored these
    assert store.store(hashes[:75], blocks[:75]) == 75
    store.wait_for_writes()
    registry = CollectorRegistry()
    metrics.register(store, registry, namespace_label="m1")
    for _ in range(2):  # scheduled twice
        assert store.lookup(hashes, request_id="req-1").num_hit_blocks == 100
        store.load(hashes, request_id="req-1").lease.release()
    s = scrape(registry)
    assert value(s, "kvtier_lookup_tokens_total", namespace="m1") == 1000
    assert value(s, "kvtier_hit_tokens_total", namespace="m1", tier="GPU") == 600
    assert value(s, "kvtier_remote_lookup_tokens_total", namespace="m1") == 400
    assert value(s, "kvtier_hit_tokens_total", namespace="m1", tier="REMOTE") == 200
