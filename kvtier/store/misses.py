"""Why a token missed: the reasons, their classifier, what the store remembers to tell them.

Every prompt token that a counted lookup or load did not serve from the cache is counted
once in ``stats.miss_tokens[(reason, tier)]`` (tier ``""`` where none applies), so for a
connector that loads what it looks up: prompt tokens = loaded tokens + missed tokens.

==================== ================ ==========================================================
reason               tier             the block (or the tokens) ...
==================== ================ ==========================================================
never_stored         ""               is in no tier and nothing says it ever was
evicted              where it left    was evicted recently: a ghost of that tier's SLRU (the
                                      lowest tier that remembers it: where its last copy was)
other_namespace      ""               has the same tokens as a block stored under another chain
                                      root (model, revision, dtype, LoRA, salt, ...): ``detail``
                                      names the fields that differ where this process saw both
                                      key contexts (:func:`kvtier.hashing.known_context`)
token_mismatch       where it is      is held under this block hash, but computed from other
                                      tokens than the prompt's (its token fingerprint differs:
                                      a hash collision, a forged or misplaced record); never
                                      served, kept for its own tokens; also for its later
                                      lookups while remembered
failed_verification  where it failed  failed another check on load (``detail``: the load-
                                      failure reason, e.g. ``corrupt``) and was dropped; also
                                      for its later lookups while remembered (every failed
                                      load is remembered, by its own reason)
remote_unavailable   REMOTE           could not be asked of the REMOTE tier or read from it
                                      (down, timed out, paused after a failure)
load_failed          where it was     its load failed for another reason (``detail``: missing,
                                      cancelled, error, ...)
after_gap            where it is      is held, but an earlier block of the chain missed: a hit
                                      is a prefix, so it cannot be used
beyond_top_capacity  where it is      is held, but the prefix is longer than the top pool
no_free_slot         where it is      is held, but every top-pool slot was pinned
partial_tail         ""               tokens after the last full block looked up (a partial
                                      block is never cached; connectors also leave the last
                                      token of a fully cached prompt to prefill)
==================== ================ ==========================================================

Load failures are mapped from their reason strings (``stats.load_failures``): the transport
reasons of :data:`TRANSPORT_REASONS` are ``remote_unavailable`` (REMOTE) or ``load_failed``,
every other reason (``corrupt``, and any check added later, such as ``token_mismatch``) is
``failed_verification``. Nothing here is a closed list of verification checks.

Every function here expects the store's lock held.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

from kvtier.hashing import context_difference, known_context
from kvtier.store.placement import Placement
from kvtier.store.results import PromptInfo
from kvtier.types import BlockHash, Medium

NEVER_STORED = "never_stored"
EVICTED = "evicted"
OTHER_NAMESPACE = "other_namespace"
TOKEN_MISMATCH = "token_mismatch"
FAILED_VERIFICATION = "failed_verification"
REMOTE_UNAVAILABLE = "remote_unavailable"
LOAD_FAILED = "load_failed"
AFTER_GAP = "after_gap"
BEYOND_TOP_CAPACITY = "beyond_top_capacity"
NO_FREE_SLOT = "no_free_slot"
PARTIAL_TAIL = "partial_tail"

REASONS: dict[str, str] = {
    NEVER_STORED: "never stored",
    EVICTED: "evicted",
    OTHER_NAMESPACE: "stored under another namespace",
    TOKEN_MISMATCH: "held, but computed from other tokens",
    FAILED_VERIFICATION: "failed verification",
    REMOTE_UNAVAILABLE: "REMOTE unavailable or timed out",
    LOAD_FAILED: "load failed",
    AFTER_GAP: "held, but after an earlier miss",
    BEYOND_TOP_CAPACITY: "held, but beyond the top pool's capacity",
    NO_FREE_SLOT: "held, but no free top-pool slot",
    PARTIAL_TAIL: "partial tail block (never cached)",
}
"""Every reason and how to say it (the order of the table above)."""

TRANSPORT_REASONS = frozenset({"timeout", "unavailable", "skipped", "missing", "cancelled", "error", "protocol"})
"""Load-failure reasons that are not a failed check of the block's bytes or tokens."""

FAILED_REMEMBERED = 4096
"""Blocks whose failed verification is remembered (their records are dropped)."""
CONTENT_KEYS_REMEMBERED = 1 << 16
"""Content keys remembered per process (:class:`ContentIndex`)."""

Miss = tuple[str, str, str]
"""``(reason, tier, detail)`` of one block."""


def load_failure_reason(tier: str, failure: str) -> str:
    """The miss reason of a block whose load failed with ``failure`` (a load-failure
    reason string, e.g. ``"corrupt"``) from ``tier``."""
    if failure in TRANSPORT_REASONS:
        return REMOTE_UNAVAILABLE if tier == str(Medium.REMOTE) and failure != "missing" else LOAD_FAILED
    if failure == TOKEN_MISMATCH:
        return TOKEN_MISMATCH
    return FAILED_VERIFICATION


class ContentIndex:
    """Recent content keys (:func:`kvtier.hashing.content_keys`) -> the chain root that
    stored them; bounded, most recent last. One per process by default (:data:`SHARED`), so
    that two stores of one process (two models, two dtypes) can tell each other's blocks.
    A daemon never fills it from clients' puts (they carry no content keys): nothing of one
    tenant's prompts reaches another's explanations."""

    def __init__(self, max_entries: int = CONTENT_KEYS_REMEMBERED) -> None:
        self.max_entries = max_entries
        self._roots: OrderedDict[bytes, bytes] = OrderedDict()

    def note(self, content_keys: Sequence[bytes], root: bytes) -> None:
        for key in content_keys:
            self._roots[key] = root
            self._roots.move_to_end(key)
        while len(self._roots) > self.max_entries:
            self._roots.popitem(last=False)

    def root_of(self, content_key: bytes) -> bytes | None:
        return self._roots.get(content_key)


SHARED = ContentIndex()


@dataclass(slots=True)
class MissMemory:
    """What one store remembers to explain misses: blocks whose load failed (a failed
    check drops the record), and the content index it notes its stores in."""

    content: ContentIndex = field(default_factory=lambda: SHARED)
    failed: OrderedDict = field(default_factory=OrderedDict)  # block_hash -> (tier, failure)

    def note_failed(self, block_hash: BlockHash, tier: str, failure: str) -> None:
        self.failed[block_hash] = (tier, failure)
        self.failed.move_to_end(block_hash)
        while len(self.failed) > FAILED_REMEMBERED:
            self.failed.popitem(last=False)

    def note_stored(self, block_hashes: Sequence[BlockHash], prompt: PromptInfo | None, root: bytes) -> None:
        """Blocks stored (or written again) are no longer failed; their content keys are noted."""
        for h in block_hashes:
            self.failed.pop(h, None)
        if prompt is not None and prompt.content_keys is not None:
            self.content.note(list(prompt.content_keys)[: len(block_hashes)], prompt.root or root)


def classify(
    placement: Placement, memory: MissMemory, block_hashes: Sequence[BlockHash], start: int,
    remote_down: bool, prompt: PromptInfo | None, namespace: bytes,
) -> list[Miss]:
    """The reason of each block of ``block_hashes[start:]``, the blocks after the prefix the
    tiers hold (block ``start`` is the first that missed)."""
    keys = prompt.content_keys if prompt is not None else None
    root = (prompt.root if prompt is not None else None) or namespace
    tiers = [*([placement.disk] if placement.disk is not None else []), *reversed(placement.pools)]
    misses: list[Miss] = []
    for i in range(start, len(block_hashes)):
        h = block_hashes[i]
        medium = placement.medium_of(h) if i > start else None
        if medium is not None:
            misses.append((AFTER_GAP, str(medium), ""))
            continue
        failed = memory.failed.get(h)
        if failed is not None:
            misses.append((load_failure_reason(failed[0], failed[1]), failed[0], failed[1]))
            continue
        if remote_down:
            misses.append((REMOTE_UNAVAILABLE, str(Medium.REMOTE), ""))
            continue
        ghost = next((tier for tier in tiers if tier.was_evicted(h)), None)
        if ghost is not None:
            misses.append((EVICTED, str(getattr(ghost, "medium", Medium.DISK)), ""))
            continue
        other = memory.content.root_of(keys[i]) if keys is not None and i < len(keys) else None
        if other is not None and other != root:
            misses.append((OTHER_NAMESPACE, "", describe_other_namespace(root, other)))
            continue
        misses.append((NEVER_STORED, "", ""))
    return misses


def describe_other_namespace(root: bytes, other: bytes) -> str:
    """``"lora_name: None vs 'a'"``: the key fields that differ between this chain's root and
    the one that stored the same tokens, where this process saw both contexts."""
    mine, theirs = known_context(root), known_context(other)
    if mine is None or theirs is None:
        return "another namespace (its key fields are unknown to this process)"
    diff = context_difference(mine, theirs)
    return "; ".join(f"{name}: {a!r} here vs {b!r} there" for name, (a, b) in diff.items()) or "another namespace"


def tail_tokens(prompt: PromptInfo | None, num_blocks: int, block_size: int) -> int:
    """Prompt tokens after the ``num_blocks`` looked up (0 when the length is unknown)."""
    if prompt is None or prompt.num_tokens is None:
        return 0
    return max(prompt.num_tokens - num_blocks * block_size, 0)


def count(stats_miss_tokens: Any, misses: Sequence[Miss], block_size: int, tail: int = 0) -> None:
    """Add ``misses`` (blocks) and ``tail`` tokens to ``stats.miss_tokens``."""
    for reason, tier, _ in misses:
        stats_miss_tokens[(reason, tier)] += block_size
    if tail:
        stats_miss_tokens[(PARTIAL_TAIL, "")] += tail


# -- explanations --------------------------------------------------------------------------------
@dataclass(slots=True)
class BlockExplanation:
    """One block of an explained prompt: a hit (``reason`` ``None``) from ``tier``, or a
    miss and why."""

    index: int
    tier: str
    reason: str | None = None
    detail: str = ""


@dataclass
class Explanation:
    """Where each block of a prompt would hit and why the rest would miss
    (:meth:`kvtier.store.TieredStore.explain`).

    Attributes:
        block_size: tokens per block.
        blocks: one entry per full block looked up, in prompt order.
        tail_tokens: prompt tokens after them (``partial_tail``).
    """

    block_size: int
    blocks: list[BlockExplanation]
    tail_tokens: int = 0

    @property
    def hit_tokens(self) -> int:
        return sum(self.block_size for b in self.blocks if b.reason is None)

    @property
    def miss_tokens(self) -> dict[tuple[str, str], int]:
        """Missed tokens by ``(reason, tier)``, as the store's counter would count them."""
        out: dict[tuple[str, str], int] = {}
        for b in self.blocks:
            if b.reason is not None:
                out[(b.reason, b.tier)] = out.get((b.reason, b.tier), 0) + self.block_size
        if self.tail_tokens:
            out[(PARTIAL_TAIL, "")] = self.tail_tokens
        return out

    def runs(self) -> Iterator[tuple[int, int, BlockExplanation]]:
        """``(first, last, block)`` for each run of consecutive blocks that read alike."""
        start = 0
        for i in range(1, len(self.blocks) + 1):
            a = self.blocks[start]
            if i == len(self.blocks) or (self.blocks[i].tier, self.blocks[i].reason, self.blocks[i].detail) != (
                a.tier, a.reason, a.detail
            ):
                yield start, i - 1, a
                start = i

    def to_dict(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "tail_tokens": self.tail_tokens, "hit_tokens": self.hit_tokens,
                "blocks": [asdict(b) for b in self.blocks]}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "Explanation":
        """Parse :meth:`to_dict`'s document (a daemon's reply). Raises ``ValueError``."""
        try:
            blocks = [BlockExplanation(int(b["index"]), str(b["tier"]), None if b["reason"] is None else str(b["reason"]),
                                       str(b.get("detail", ""))) for b in doc["blocks"]]
            return cls(int(doc["block_size"]), blocks, int(doc.get("tail_tokens", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"expected an explanation document, got {exc!r}") from None


def explain(
    placement: Placement, memory: MissMemory, block_hashes: Sequence[BlockHash], media: Sequence[Medium],
    remote_down: bool, prompt: PromptInfo | None, namespace: bytes,
) -> Explanation:
    """Each block's fate under a load now: hits from ``media`` (the walked prefix) up to
    the top pool's capacity and its slots free or evictable now, then the reasons of the
    rest (the caller holds the lock)."""
    top = placement.top
    loadable = min(len(media), top.num_blocks)
    slots = placement.free_top_slots(block_hashes[:loadable])
    blocks: list[BlockExplanation] = []
    for i in range(loadable):
        moved = media[i] is not top.medium
        slots -= moved
        blocks.append(BlockExplanation(i, str(media[i]), NO_FREE_SLOT if moved and slots < 0 else None))
    if any(b.reason for b in blocks):  # a load stops at the first block without a slot
        first = next(i for i, b in enumerate(blocks) if b.reason)
        blocks[first:] = [BlockExplanation(b.index, b.tier, NO_FREE_SLOT) for b in blocks[first:]]
    blocks += [BlockExplanation(i, str(media[i]), BEYOND_TOP_CAPACITY) for i in range(loadable, len(media))]
    found = classify(placement, memory, block_hashes, len(media), remote_down, prompt, namespace)
    blocks += [BlockExplanation(len(media) + k, tier, reason, detail) for k, (reason, tier, detail) in enumerate(found)]
    block_size = placement.spec.block_size
    return Explanation(block_size, blocks, tail_tokens(prompt, len(block_hashes), block_size))
