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


def test_touch_many_orders_the_index_as_touching_one_by_one():
    import random

    from kvtier.tiers.lru import SegmentedLRU

    rng = random.Random(7)
    for trial in range(200):
        one, many = SegmentedLRU(max_ghosts=8, protected_fraction=rng.choice([0.2, 0.5, 0.8])), None
        many = SegmentedLRU(max_ghosts=8, protected_fraction=one.protected_fraction)
        for key in range(rng.randint(1, 40)):
            one.add(key, key)
            many.add(key, key)
        for _ in range(rng.randint(1, 4)):
            keys = rng.sample(range(50), rng.randint(0, 30))  # some not indexed: skipped
            for key in keys:
                if key in one:
                    one.touch(key)
            many.touch_many(keys)
            assert list(one.eviction_order()) == list(many.eviction_order()), trial
            assert [one.is_protected(k) for k in range(50)] == [many.is_protected(k) for k in range(50)], trial
