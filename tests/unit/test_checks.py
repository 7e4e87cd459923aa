"""kvtier.checks: the one set of boundary rules for namespaces and block hashes, and the
backoff policy of the REMOTE clients (kvtier.tiers.backoff)."""

from __future__ import annotations

import time

import pytest

from kvtier.checks import BatchTooLarge, check_block_hashes, check_namespace, namespace_hex, parse_namespace
from kvtier.tiers.backoff import Backoff

NS = bytes(range(32))


def test_a_namespace_round_trips_through_its_hex_spelling():
    assert namespace_hex(NS) == NS.hex() and len(namespace_hex(NS)) == 64
    assert parse_namespace(NS.hex()) == NS
    assert check_namespace(NS) is NS


@pytest.mark.parametrize("text", [
    " " * 64,                         # bytes.fromhex: b"", i.e. the data directory itself (issue 12)
    "00" * 31 + "  ",                 # 64 characters, 31 bytes
    "00" * 31 + " 0 ",                # whitespace inside
    "\t" + "0" * 63,
    "0" * 63 + "\n",                  # a regex with $ would let this one through
    NS.hex().upper(),                 # one spelling per namespace: its directory name
    "0" * 63, "0" * 65, "", "zz" * 32, "+" + "0" * 63,
    "٠" * 64,                         # unicode digits (Arabic-Indic zero)
    "０" * 64,                        # fullwidth zero
])
def test_parse_namespace_takes_exactly_64_lowercase_hex_digits(text):
    with pytest.raises(ValueError, match="expected the namespace as 64 lowercase hex digits"):
        parse_namespace(text)


@pytest.mark.parametrize("value", [b"", b"\x00" * 31, b"\x00" * 33, NS.hex(), bytearray(NS), None, 7])
def test_check_namespace_takes_32_bytes_only(value):
    with pytest.raises(ValueError, match="expected a namespace of 32 bytes, got"):
        check_namespace(value)


def test_block_hashes_are_bytes_of_16_or_32():
    hashes = [b"\x01" * 16, b"\x02" * 32]
    assert check_block_hashes(hashes) is hashes  # a list comes back as it is: no copy
    assert check_block_hashes(tuple(hashes)) == hashes
    assert check_block_hashes([]) == []
    for bad in (b"", b"\x00" * 15, b"\x00" * 17, b"\x00" * 31, b"\x00" * 33, b"\x00" * 64, "x" * 32, 5, None):
        with pytest.raises(ValueError, match="expected block hashes as bytes of 16 or 32 bytes, got .* at index 1"):
            check_block_hashes([b"\x00" * 32, bad])
    for bad in (b"\x00" * 32, "abc", 7, {b"\x00" * 32: 1}, None):
        with pytest.raises(ValueError, match="expected block hashes as a list of bytes"):
            check_block_hashes(bad)


def test_a_batch_over_the_limit_is_batch_too_large():
    hashes = [b"\x00" * 32] * 4
    assert check_block_hashes(hashes, max_blocks=4) == hashes
    with pytest.raises(BatchTooLarge, match="expected at most 3 block hashes per call, got 4"):
        check_block_hashes(hashes, max_blocks=3)
    assert issubclass(BatchTooLarge, ValueError)


def test_the_store_and_the_remote_clients_apply_the_same_rule(make_store):
    """One rule everywhere: a hash the daemon would refuse is refused by the store too."""
    from kvtier.testing import MemoryRemote

    store = make_store()
    remote = MemoryRemote()
    for bad in (b"\x00" * 20, b"\x00"):
        with pytest.raises(ValueError, match="16 or 32 bytes"):
            store.lookup([bad])
        with pytest.raises(ValueError, match="16 or 32 bytes"):
            remote.lookup(NS, [bad])


# -- backoff -------------------------------------------------------------------------------------
def test_backoff_doubles_per_failure_up_to_the_limit_and_a_success_ends_it():
    backoff = Backoff(0.01, 0.05)
    assert not backoff.down and not backoff.paused() and not backoff.succeeded()
    assert [backoff.failed() for _ in range(5)] == [0.01, 0.02, 0.04, 0.05, 0.05]
    assert backoff.down and backoff.paused()
    time.sleep(0.06)
    assert not backoff.paused() and backoff.down  # the pause is over; the next call probes
    assert backoff.succeeded() and not backoff.down
    assert backoff.failed() == 0.01  # starts over


def test_backoff_limits_are_checked():
    for min_s, max_s in ((0, 1), (-1, 1), (0.5, 0.1), (True, 1), ("1", 2)):
        with pytest.raises(ValueError, match="expected backoff"):
            Backoff(min_s, max_s)


def test_both_remote_clients_use_the_policy_with_the_same_defaults():
    pytest.importorskip("redis")
    from kvtier.tiers.redis import RedisTier
    from kvtier.tiers.remote import RemoteTier

    remote, redis = RemoteTier("http://127.0.0.1:1"), RedisTier("redis://127.0.0.1:1")
    assert (remote.backoff.min_s, remote.backoff.max_s) == (redis.backoff.min_s, redis.backoff.max_s) == (0.05, 2.0)
    assert RedisTier("redis://127.0.0.1:1", backoff_s=0.2, max_backoff_s=0.4).backoff.max_s == 0.4
    remote.close()
    redis.close()
