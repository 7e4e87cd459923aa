"""When a REMOTE backend counts as down: the one backoff policy of RemoteTier and RedisTier.

After a call fails for a remote-side reason (refused, reset, timed out, 5xx, a cluster that
is down), the remote counts as down for a pause: calls in that pause are misses at once
(the clients count them as ``skipped``), so an inference loop never waits on a dead remote
more than once per pause; the first call after the pause tries again (reconnects). The pause
starts at ``min_s`` and doubles with each consecutive failure up to ``max_s``; a call that
succeeds ends the backoff.

Defaults: 50 ms (a restarted daemon or a failed-over Redis is used again almost at once)
doubling up to 2 s (a remote that hangs costs a caller at most one timeout per 2 s).
"""

from __future__ import annotations

import threading
import time

MIN_S = 0.05
MAX_S = 2.0


class Backoff:
    """Thread-safe backoff state of one remote.

    Args:
        min_s: the first pause after a failure, seconds (> 0).
        max_s: the longest pause, seconds (>= ``min_s``).

    Raises:
        ValueError: limits that are not ``0 < min_s <= max_s``.
    """

    def __init__(self, min_s: float = MIN_S, max_s: float = MAX_S) -> None:
        for name, value in (("min_s", min_s), ("max_s", max_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"expected backoff {name} > 0 seconds, got {value!r}")
        if max_s < min_s:
            raise ValueError(f"expected backoff max_s >= min_s ({min_s}), got {max_s!r}")
        self.min_s, self.max_s = float(min_s), float(max_s)
        self._lock = threading.Lock()
        self._pause_s = 0.0  # 0: not backing off
        self._until = 0.0

    @property
    def down(self) -> bool:
        """The last call failed (no call succeeded since)."""
        return self._pause_s > 0

    def paused(self) -> bool:
        """Within the pause after a failure: the call should be a miss, without the network."""
        return time.monotonic() < self._until

    def failed(self) -> float:
        """Record a failed call; returns the pause it starts, seconds (``min_s`` for the
        first failure after a success, then doubling up to ``max_s``)."""
        with self._lock:
            self._pause_s = min(self.max_s, 2 * self._pause_s) if self._pause_s else self.min_s
            self._until = time.monotonic() + self._pause_s
            return self._pause_s

    def succeeded(self) -> bool:
        """Record a call that reached the remote; ``True`` when that ends a backoff."""
        if not self._pause_s:
            return False
        with self._lock:
            was_down = self._pause_s > 0
            self._pause_s, self._until = 0.0, 0.0
            return was_down
