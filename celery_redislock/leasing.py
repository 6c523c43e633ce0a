"""A held lock's lease and what its replies mean: shared by every handle and renewer (no I/O).

``LockHandle`` and ``AsyncLockHandle`` are both a :class:`Lease` (one
arithmetic, one reading of the replies, the same logs and signals); their
modules and the two renewers only do the I/O, blocking or awaited.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from celery_redislock import signals
from celery_redislock._clock import clock
from celery_redislock._process import current_pid
from celery_redislock.exceptions import LockBackendError, LockNotOwned
from celery_redislock.outcomes import RELEASE_NAMES, ReleaseOutcome, RenewOutcome
from celery_redislock.protocol import RELEASE_RETRIED
from celery_redislock.settings import validate_ttl

__all__ = [
    "Lease",
    "Renewable",
    "due_for_renewal",
    "renewal_failed",
    "renewal_replied",
    "report_lost",
]

# The logger keeps the name the docs document (the module was lock.py).
logger = logging.getLogger("celery_redislock.lock")

# Redis expiry and our clock can drift apart a little; treat the lock as
# valid locally for slightly less than Redis does (Redlock's drift rule).
_DRIFT_FACTOR = 0.01
_DRIFT_FLOOR = 0.002
#: Taken to claim a loss report: the renewer and the release may both find
#: the loss at once (rare: one lock for every handle is enough).
_LOSS_CLAIM = threading.Lock()


class Lease:
    """The lease of one acquisition: its deadlines, its loss, how its replies read.

    Subclasses do the I/O and provide ``_stop_renewal``.
    """

    # An extend and a renewal in flight together run at the server in either
    # order: whichever ran last set the key's TTL. These say which overlapped
    # (class defaults: nothing is paid per acquisition until one is sent).
    #: The latest renewal sent: when, and the TTL (ms) it carried.
    _renewal_sent: tuple[float, int] = (0.0, 0)
    #: When the latest renewal's reply was read (0: not yet, or it failed).
    _renewal_read_at = 0.0
    #: When the latest extend was sent.
    _extend_sent_at = float("-inf")

    def __init__(
        self,
        backend: Any,
        key: str,
        value: str,
        ttl: float,
        granted_at: float,
        task_name: str,
        task_id: str | None,
        sender: Any,
        fence: int | None,
    ) -> None:
        self.backend = backend
        self._fence = fence
        self.fenced = fence is not None
        self.key = key
        self.value = value
        self.task_name = task_name
        self.task_id = task_id
        self.sender = sender
        self._set_ttl(ttl)
        self.acquired_at = granted_at
        self.renew_at = granted_at + self.renew_period
        self.valid_until = self._validity_from(granted_at)
        self.lost_reason: str | None = None
        #: True once the holder started to release (renewal and aborts stop).
        self.released = False
        self.renewals = 0
        self._release_done = False
        self._release_sent = False
        self._pid = current_pid()
        self._on_lost: list[Callable[[Any], None]] = []

    def _set_ttl(self, ttl: float) -> None:
        self.ttl = ttl
        self.ttl_ms = max(int(ttl * 1000), 1)
        self.renew_period = ttl / 3

    def _validity_from(self, sent_at: float, ttl: float | None = None) -> float:
        return sent_at + (self.ttl if ttl is None else ttl) * (1 - _DRIFT_FACTOR) - _DRIFT_FLOOR

    def renewal_item(self, sent_at: float) -> tuple[str, str, int, bool]:
        """What a renewal sent at ``sent_at`` carries for this lock (and remember it)."""
        self._renewal_sent = (sent_at, self.ttl_ms)
        return self.key, self.value, self.ttl_ms, self.fenced

    def __repr__(self) -> str:
        state = "released" if self.released else ("lost" if self.lost else "held")
        return f"<{type(self).__name__} {self.key!r} {state}>"

    def _known_fence(self) -> int | None:
        """The fence issued already (``None``: ask the store for one).

        Raises:
            LockNotOwned: none was issued and the lock was released.
        """
        if self._fence is None and self.released:
            raise LockNotOwned(self.key, "it was released")
        return self._fence

    def _fence_issued(self, fence: int | None) -> int:
        """The fence the store issued (``None``: the value was gone), kept from now on."""
        if fence is None:
            raise LockNotOwned(self.key, "it no longer holds this acquisition's value")
        self._fence, self.fenced = fence, True
        return fence

    def _may_release(self) -> bool:
        """False when there is nothing to send: already released, or another process's lock."""
        if self._release_done:
            return False
        if self._pid != current_pid():
            logger.warning(
                "not releasing lock %s from pid %d: it was acquired by pid %d",
                self.key,
                current_pid(),
                self._pid,
            )
            return False
        return True

    def _named(self) -> tuple[str, tuple[Any, ...]]:
        """How the log lines name this lock: a format and its arguments."""
        return "lock %s", (self.key,)

    @property
    def lost(self) -> bool:
        """True once the renewer (or the release) found the lock gone or taken over."""
        return self.lost_reason is not None

    @property
    def owned(self) -> bool:
        """True while held: not released, not lost, and within its validity.

        This is a local check with no round trip; it turns False as soon as
        the last confirmed grant or renewal is older than the TTL.
        """
        return not self.released and not self.lost and clock() < self.valid_until

    @property
    def held_for(self) -> float:
        """Seconds since the lock was granted."""
        return clock() - self.acquired_at

    def on_lost(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(handle)`` from the renewer if the lock is lost.

        The callback must not block; exceptions it raises are logged.
        """
        self._on_lost.append(callback)

    def _stop_renewal(self) -> None:
        raise NotImplementedError

    def _renewed(self, sent_at: float) -> None:
        if self.released or self.lost:
            return
        self.renewals += 1
        self._renewal_read_at = clock()
        ttl = self._renewal_sent[1] / 1000 if self._renewal_sent[0] == sent_at else self.ttl
        if ttl != self.ttl or self._extend_sent_at > sent_at:
            # An extend overlapped it, and may have run first (review helper-55
            # F1: read with the extend's TTL, the lease outlived the key).
            self.valid_until = min(self.valid_until, self._validity_from(sent_at, ttl))
            self.renew_at = min(self.renew_at, sent_at + ttl / 3)
        else:
            self.valid_until = self._validity_from(sent_at)
            self.renew_at = sent_at + self.renew_period
        signals.lock_renewed.send(
            sender=self.sender,
            key=self.key,
            task_name=self.task_name,
            task_id=self.task_id,
            held=self.held_for,
        )

    def _mark_lost(self, reason: str) -> None:
        if self.released or not self._claim_loss(reason):
            return
        self._stop_renewal()
        report_lost(self, reason, self._on_lost)

    def _claim_loss(self, reason: str) -> bool:
        """Set the loss's reason unless one was set: True for the one who reports it."""
        with _LOSS_CLAIM:
            if self.lost:
                return False
            self.lost_reason = reason
            return True

    def _extending(self, ttl: float | None) -> float:
        """Before an extend is sent: check, take the new TTL; return the send time.

        A new TTL counts from the send: the extend may run although its reply
        never comes (a timeout, a cancellation), so the lease keeps the
        earlier of the two deadlines until a reply confirms it (review
        helper-54 F1: ``owned`` stayed True for the old TTL after the key
        expired), and the renewer is told when the next renewal moves ahead.

        Raises:
            LockNotOwned: released, or acquired by another process (a forked
                child must not shorten its parent's lock: helper-54 F2).
        """
        if self.released:
            raise LockNotOwned(self.key, "it was released")
        if self._pid != current_pid():
            raise LockNotOwned(self.key, f"it was acquired by pid {self._pid}, not by this process")
        sent_at = self._extend_sent_at = clock()
        if ttl is not None:
            self._set_ttl(validate_ttl(ttl, "ttl"))
            self.valid_until = min(self.valid_until, self._validity_from(sent_at))
            if sent_at + self.renew_period < self.renew_at:
                self.renew_at = sent_at + self.renew_period
                self._renewal_moved()
        return sent_at

    def _renewal_moved(self) -> None:
        """``renew_at`` moved ahead: the renewer, asleep until the old one, must look again."""
        raise NotImplementedError

    def _extended(self, outcome: RenewOutcome, sent_at: float) -> None:
        """The extend sent at ``sent_at`` found ``outcome``: a new lease, or the lock lost."""
        if outcome is RenewOutcome.RENEWED:
            self.valid_until = self._validity_from(sent_at)
            self.renew_at = sent_at + self.renew_period
            renewal_at, renewal_ttl_ms = self._renewal_sent
            if renewal_ttl_ms != self.ttl_ms and not (
                renewal_at <= self._renewal_read_at < sent_at
            ):
                # A renewal with the old TTL was in flight: it may run last.
                renewal_ttl = renewal_ttl_ms / 1000
                self.valid_until = min(
                    self.valid_until, self._validity_from(renewal_at, renewal_ttl)
                )
                self.renew_at = min(self.renew_at, renewal_at + renewal_ttl / 3)
            return
        self._mark_lost("gone" if outcome is RenewOutcome.GONE else "stolen")
        raise LockNotOwned(self.key, f"it is {self.lost_reason or 'released'}")

    def _release_failed(self, exc: LockBackendError) -> None:
        self._release_done = True
        name, args = self._named()
        logger.error(f"could not release {name}; it expires within %.1fs: %s", *args, self.ttl, exc)

    def _report_release(
        self, outcome: ReleaseOutcome, kept: bool = False, resent: bool = False
    ) -> None:
        """Log what the release found (when it is news) and send ``lock_released``.

        A loss the renewer had not seen yet (it renews at a third of the
        TTL) is reported here, as the renewer would have: the ERROR log,
        ``lock_lost``, ``on_lock_lost``. Not after a release sent again, by
        the caller (``resent``) or the store (a lost reply,
        ``RELEASE_RETRIED``): another holder may then follow our own release.
        """
        self._release_done = True
        released = outcome is ReleaseOutcome.RELEASED
        if not released:
            self._report_not_released(outcome, resent)
        signals.lock_released.send(
            sender=self.sender,
            key=self.key,
            task_name=self.task_name,
            task_id=self.task_id,
            held=self.held_for,
            outcome="kept" if kept and released else RELEASE_NAMES[outcome],
        )

    def _report_not_released(self, outcome: ReleaseOutcome, resent: bool) -> None:
        """The release found the key gone or another's: log it, and report a loss that is news."""
        name, args = self._named()
        if outcome is ReleaseOutcome.NOT_OURS:
            logger.warning(
                f"{name} was no longer ours at release (held %.3fs); "
                "another holder has it and was left alone",
                *args,
                self.held_for,
            )
        elif outcome is ReleaseOutcome.ALREADY_GONE and not self.lost:
            logger.warning(
                f"{name} had already expired at release (held %.3fs)", *args, self.held_for
            )
        ambiguous = resent or RELEASE_RETRIED.get()
        reason = "stolen" if outcome is ReleaseOutcome.NOT_OURS else "gone"
        if not ambiguous and self._claim_loss(reason):
            # The abort callback (lock_on_lost="abort") is a no-op by now:
            # the execution finished before the release was sent.
            report_lost(self, reason, self._on_lost)


#: What a renewer keeps alive (the name it has always had there).
Renewable = Lease


def report_lost(handle: Any, reason: str, callbacks: list[Callable[[Any], None]]) -> None:
    """Report a lost lock: the ERROR log, ``lock_lost``, then each callback.

    Every kind of handle (task, standalone, asyncio) reports a loss through
    this, once, so operators see the same log line and signal for all.
    """
    logger.error(
        "lock %s of %s[%s] was lost (%s) after %.3fs; another execution may now run",
        handle.key,
        handle.task_name,
        handle.task_id,
        reason,
        handle.held_for,
    )
    signals.lock_lost.send(
        sender=handle.sender,
        key=handle.key,
        task_name=handle.task_name,
        task_id=handle.task_id,
        reason=reason,
        held=handle.held_for,
    )
    for callback in callbacks:
        try:
            callback(handle)
        except Exception:
            logger.exception("lock-lost callback %r raised", callback)


def due_for_renewal(handles: Sequence[Renewable], now: float) -> list[Renewable]:
    """The handles due for renewal at ``now``, or at least half-way to due (coalesced)."""
    return [h for h in handles if h.renew_at - h.renew_period / 2 <= now]


def renewal_failed(handles: Sequence[Renewable], exc: Exception, log: logging.Logger) -> None:
    """A renewal round trip for ``handles`` raised ``exc`` (call it in the ``except``).

    Redis unreachable (LockBackendError) or anything unexpected: either way
    this backend's locks stay valid until their deadline, and the other
    backends' locks are not affected.
    """
    now = clock()
    if isinstance(exc, LockBackendError):
        log.warning("could not renew %d lock(s): %s", len(handles), exc)
    else:
        log.exception("could not renew %d lock(s)", len(handles))
    for handle in handles:
        if now >= handle.valid_until:
            handle._mark_lost("expired_locally")
        else:
            # Try again soon, while the lock is still valid.
            handle.renew_at = now + min(handle.renew_period / 4, 1.0)


def renewal_replied(
    handles: Sequence[Renewable],
    outcomes: Sequence[RenewOutcome],
    sent_at: float,
    still_held: Callable[[Renewable], bool] = lambda _handle: True,
) -> None:
    """Apply a renewal's ``outcomes``, sent at ``sent_at``, to the ``handles`` still held."""
    for handle, outcome in zip(handles, outcomes, strict=False):
        if not still_held(handle):
            continue  # released while the renewal was in flight
        if handle.released or handle.lost:
            # Registered again by an extend racing its release or loss
            # (review helper-55 F2): renewed, it would be due for ever.
            handle._stop_renewal()
            continue
        if outcome is RenewOutcome.RENEWED:
            handle._renewed(sent_at)
        elif outcome is RenewOutcome.GONE:
            handle._mark_lost("gone")
        else:
            handle._mark_lost("stolen")
