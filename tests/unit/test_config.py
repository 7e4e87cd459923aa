"""StoreConfig: validation, byte sizes, environment variables and CLI flags."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from kvtier.config import StoreConfig, config_from_cli, config_options, parse_bytes
from tests.conftest import BLOCK_SIZE


def test_parse_bytes_units():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes(4096) == 4096
    for bad in ("lots", "-1", "5 parsecs", -3):
        with pytest.raises(ValueError, match="byte size"):
            parse_bytes(bad)


def test_env_maps_onto_fields_and_overrides_win(tmp_path):
    env = {
        "KVTIER_GPU_BYTES": "1MiB",
        "KVTIER_CPU_BYTES": "0",
        "KVTIER_BLOCK_SIZE": "32",
        "KVTIER_WRITE_POLICY": "write_through",
        "KVTIER_DATA_DIR": str(tmp_path),
        "KVTIER_FLUSH_ON_CLOSE": "false",
    }
    config = StoreConfig.from_env(env, block_size=None, hash_name="xxh3_128")
    assert (config.gpu_bytes, config.cpu_bytes, config.block_size) == (2**20, 0, 32)
    assert config.write_policy == "write_through" and config.hash_name == "xxh3_128"
    assert config.data_dir == tmp_path and config.flush_on_close is False


@pytest.mark.parametrize(
    "kwargs",
    [{"block_size": 0}, {"hash_name": "md5"}, {"write_policy": "sometimes"}, {"gpu_bytes": 0, "cpu_bytes": 0, "disk_bytes": 0}],
)
def test_invalid_config_raises_value_error(kwargs):
    with pytest.raises(ValueError, match="expected"):
        StoreConfig(**kwargs)


def test_cli_flags_map_onto_fields(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_GPU_BYTES", raising=False)
    seen = {}

    @click.command()
    @config_options
    def cmd(**options):
        seen["config"] = config_from_cli(options)

    result = CliRunner().invoke(
        cmd, ["--gpu-bytes", "64MiB", "--block-size", "8", "--data-dir", str(tmp_path), "--no-flush-on-close"]
    )
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.gpu_bytes, config.block_size, config.data_dir, config.flush_on_close) == (64 * 2**20, 8, tmp_path, False)
    bad = CliRunner().invoke(cmd, ["--write-policy", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output


def test_config_hash_names_are_the_hash_functions_of_kvtier_hashing():
    """kvtier.config spells the hash names itself (it must not import kvtier.hashing, which
    pulls in numpy and torch, for `kvtier --help`); they must stay the ones hashing implements."""
    from kvtier.config import HASH_NAMES
    from kvtier.hashing import HASH_NAMES as IMPLEMENTED

    assert HASH_NAMES == IMPLEMENTED
    for name in IMPLEMENTED:
        assert StoreConfig(hash_name=name).hash_name == name


def test_disk_only_config_is_refused_at_construction_not_at_first_store(tmp_path, opened):
    with pytest.raises(ValueError, match="gpu_bytes or cpu_bytes"):
        StoreConfig(gpu_bytes=0, cpu_bytes=0, disk_bytes=1 << 20, block_size=BLOCK_SIZE, data_dir=tmp_path)


@pytest.mark.parametrize(
    "env",
    [
        {"KVTIER_GPU_BYTES": "lots"},
        {"KVTIER_CPU_BYTES": "-5"},
        {"KVTIER_DISK_BYTES": "12 parsecs"},
        {"KVTIER_BLOCK_SIZE": "x"},
        {"KVTIER_BLOCK_SIZE": "-16"},
        {"KVTIER_NUM_IO_THREADS": "0"},
        {"KVTIER_HASH_NAME": "md5"},
        {"KVTIER_WRITE_POLICY": "sometimes"},
        {"KVTIER_GPU_BYTES": "0", "KVTIER_CPU_BYTES": "0", "KVTIER_DISK_BYTES": "0"},
    ],
)
def test_garbage_env_values_raise_value_error(env):
    with pytest.raises(ValueError, match="expected"):
        StoreConfig.from_env(env)


def test_garbage_flush_on_close_env_value_raises_value_error():
    with pytest.raises(ValueError, match="expected"):
        StoreConfig.from_env({"KVTIER_FLUSH_ON_CLOSE": "ture"})

