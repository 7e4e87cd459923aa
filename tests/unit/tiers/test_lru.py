"""SegmentedLRU: exact order for single-use keys, protection for reused ones, ghosts."""

from kvtier.tiers.lru import SegmentedLRU


def test_single_use_keys_evict_in_exact_lru_order():
    lru = SegmentedLRU(max_ghosts=8)
    for k in "abcd":
        lru.add(k, k.upper())
    lru.refresh("a")
    assert list(lru.eviction_order()) == ["b", "c", "d", "a"]
    assert lru.pop("b") == "B" and len(lru) == 3


def test_reused_key_goes_after_every_single_use_key():
    lru = SegmentedLRU(max_ghosts=8)
    for k in "abc":
        lru.add(k, 0)
    lru.touch("a")
    lru.add("d", 0)
    assert list(lru.eviction_order()) == ["b", "c", "d", "a"]
    assert lru.is_protected("a") and not lru.is_protected("d")


def test_protected_is_capped_and_demotes_its_lru():
    lru = SegmentedLRU(max_ghosts=0, protected_fraction=0.5)
    for k in "abcd":
        lru.add(k, 0)
    for k in "abc":
        lru.touch(k)  # protected may hold 2 of 4: "a" is demoted to probation's recent end
    assert list(lru.eviction_order()) == ["d", "a", "b", "c"]


def test_recently_evicted_key_returns_protected():
    lru = SegmentedLRU(max_ghosts=1)
    lru.add("a", 0)
    lru.add("b", 0)
    lru.pop("a", evicted=True)
    lru.pop("b", evicted=True)  # only one ghost is kept: "a" is forgotten
    lru.add("a", 0)
    lru.add("b", 0)
    assert not lru.is_protected("a") and lru.is_protected("b")
