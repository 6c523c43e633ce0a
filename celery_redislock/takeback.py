"""Taking back values that nobody will use: one background thread per process.

An acquire whose reply never came (a timeout, an interrupt between sending
and reading) may still run once the lock store answers, on its own closed
connection, and leave a value that blocks the key for its whole TTL. Its
caller cannot wait to find out, so it hands a *take-back* here: a
compare-and-delete of exactly that value, tried at once and then again for
about a minute, and on (every 32 s) until the value's TTL has passed: a
lock abandoned while the store was down for longer (a ``with`` block whose
release never ran, a long TTL) is freed once the store answers again,
rather than at its TTL.

All take-backs of a process share one daemon thread and one heap of due
times: a burst of failures (a lock store that froze under load) queues work,
not threads. After a fork the child starts empty; its parent keeps trying.
"""

from __future__ import annotations

import _thread
import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable

from celery_redislock._clock import clock
from celery_redislock.exceptions import LockBackendError
from celery_redislock.store import LockStore, ReleaseOutcome

__all__ = ["DELAYS", "pending", "take_back", "take_back_value"]

logger = logging.getLogger(__name__)

#: Seconds between the attempts to take a value back (about a minute in all).
DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)

#: One attempt: True once settled (deleted, or the key holds someone else's
#: value, which a late acquire could not displace); False to try again.
Attempt = Callable[[], bool]


class _Worker:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        # The condition is made on first use, not at import: the package may
        # be imported before gevent patches threading (gunicorn --preload),
        # and a greenlet waiting on a native lock would block its whole hub.
        # The guard only covers that creation, never a wait.
        self._guard = _thread.allocate_lock()
        self._cond: threading.Condition | None = None
        # (due, sequence, attempts made, until, attempt): sequence breaks ties.
        self._heap: list[tuple[float, int, int, float, Attempt]] = []
        self._sequence = itertools.count()
        self._running = False

    def _condition(self) -> threading.Condition:
        with self._guard:
            if self._cond is None:
                self._cond = threading.Condition(threading.Lock())
            return self._cond

    def add(self, attempt: Attempt, until: float = 0.0) -> None:
        cond = self._condition()
        entry = (clock() + DELAYS[0], next(self._sequence), 1, until, attempt)
        start = started = False
        try:
            with cond:
                # The flag before the entry: an interruption once it is
                # queued finds ``start`` set, and starts the thread below.
                start, self._running = not self._running, True
                heapq.heappush(self._heap, entry)
                cond.notify()
        finally:
            # Even when interrupted once the flag is set (else it would say
            # "running" with no thread, and no take-back of the process run:
            # review helper-40 F2); inline, not a call, whose first
            # instruction a signal could interrupt before any try (review
            # helper-42 F1). The interruption is raised after.
            if start:
                try:
                    thread = threading.Thread(
                        target=self._run, name="redislock-take-back", daemon=True
                    )
                    thread.start()
                    started = True
                finally:
                    if not started:  # the next take-back starts one
                        with cond:
                            self._running = False

    def pending(self) -> int:
        with self._condition():
            return len(self._heap)

    def _run(self) -> None:
        cond = self._condition()
        try:
            while True:
                with cond:
                    while not self._heap or self._heap[0][0] > clock():
                        cond.wait(None if not self._heap else self._heap[0][0] - clock())
                    _, _, made, until, attempt = heapq.heappop(self._heap)
                try:
                    settled = attempt()
                except Exception:
                    logger.exception("taking back a lock value failed")
                    settled = False
                delay = DELAYS[min(made, len(DELAYS) - 1)]
                if not settled and (made < len(DELAYS) or clock() < until):
                    with cond:
                        due = clock() + delay
                        entry = (due, next(self._sequence), made + 1, until, attempt)
                        heapq.heappush(self._heap, entry)
        finally:
            # Killed by something other than an Exception: let the next
            # take-back start a thread again.
            with cond:
                self._running = False


_WORKER = _Worker()
# The child of a fork has no thread and must not redo its parent's work.
os.register_at_fork(after_in_child=_WORKER._reset)


def take_back(attempt: Attempt, until: float = 0.0) -> None:
    """Run ``attempt`` now; if it does not settle, again from the background thread.

    Args:
        attempt: One compare-and-delete; returns True once settled. It must
            not raise for a lock-store error (return False instead).
        until: Keep trying (after the first minute's schedule) until this
            :func:`clock` time: when the value has expired by itself.
    """
    if attempt():
        return
    _WORKER.add(attempt, until)


def pending() -> int:
    """Take-backs waiting for their next attempt (for tests and the CLI)."""
    return _WORKER.pending()


def take_back_value(
    backend: LockStore,
    key: str,
    value: str,
    *,
    now: bool = True,
    limit: int = 1,
    ttl: float = 0.0,
    landed: bool = False,
) -> None:
    """Take back ``value`` from ``key`` (compare-and-delete), now and until it cannot be there.

    Args:
        backend: The lock store the value may have reached.
        key: The lock key.
        value: Exactly the value the unanswered acquire sent.
        now: Make the first attempt in the calling thread. False when the
            store has just failed: the caller should not wait on it again.
        limit: The key's ``lock_limit``: with more than one slot, the value
            is taken back from whichever slot it landed in.
        ttl: The value's time to live, in seconds: tried for about a
            minute, then on until that has passed.
        landed: The value is known to be in the store (a held lock whose
            release never ran): a key found gone settles it, as the value
            expired. False (an acquire whose reply never came): a key found
            gone may still get the value, so it is tried again.
    """

    def attempt() -> bool:
        try:
            if limit > 1:
                outcome = backend.release_slot_of(key, limit, value)
            else:
                # fenced: settle the counter, in case the holder read a fence.
                outcome = backend.release(key, value, fenced=True)
        except LockBackendError as exc:
            logger.debug("taking back lock %s: %s; trying again later", key, exc)
            return False
        return landed or outcome is not ReleaseOutcome.ALREADY_GONE

    until = clock() + ttl
    if now:
        take_back(attempt, until)
    else:
        _WORKER.add(attempt, until)
