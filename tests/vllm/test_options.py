"""``kv_connector_extra_config`` parsing (no vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.connectors.vllm.options import ConnectorOptions


def test_defaults_for_a_vllm_engine() -> None:
    options = ConnectorOptions.from_extra_config(None, block_size=128, environ={})
    store = options.store
    assert (store.gpu_bytes, store.write_policy, store.block_size) == (0, "write_through", 128)
    assert store.cpu_bytes == 4 << 30  # StoreConfig's own default
    assert (options.model_id, options.model_revision, options.match_wait_s) == (None, None, 0.05)


def test_extra_config_over_environment_over_defaults(tmp_path) -> None:
    environ = {"KVTIER_WRITE_POLICY": "write_back", "KVTIER_CPU_BYTES": "1GiB", "KVTIER_DISK_BYTES": "2GiB"}
    options = ConnectorOptions.from_extra_config(
        {"cpu_bytes": "64MiB", "data_dir": str(tmp_path), "match_wait_s": 0, "model_id": "served"}, 32, environ
    )
    store = options.store
    assert store.write_policy == "write_back"  # the environment beats the connector default
    assert (store.cpu_bytes, store.disk_bytes) == (64 << 20, 2 << 30)  # extra config beats the environment
    assert store.data_dir == Path(tmp_path)
    assert (options.match_wait_s, options.model_id) == (0, "served")


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"cpu_byte": 1}, "unknown kv_connector_extra_config keys \\['cpu_byte'\\]"),
        ({"block_size": 16}, "block_size == vLLM's block_size \\(32\\)"),
        ({"cpu_bytes": "lots"}, "byte size"),
        ({"cpu_bytes": 0, "gpu_bytes": 0}, "gpu_bytes or cpu_bytes > 0"),
        ({"match_wait_s": -1}, "match_wait_s"),
        ({"lookup_timeout_s": "1"}, "lookup_timeout_s"),
        ({"model_revision": ""}, "model_revision"),
    ],
)
def test_bad_extra_config_is_a_value_error(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorOptions.from_extra_config(extra, 32, environ={})


def test_matching_block_size_is_accepted() -> None:
    assert ConnectorOptions.from_extra_config({"block_size": 32}, 32, environ={}).store.block_size == 32
