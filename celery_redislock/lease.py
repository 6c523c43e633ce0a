"""A held lock: :class:`LockHandle`, from grant to release.

The handle carries the token (the whole stored value), its lease deadline,
the loss flag and callbacks; it registers itself with the process's renewer
(:mod:`celery_redislock.renewer`) and withdraws any pending abort
(:mod:`celery_redislock.abort`) when its execution ends. Both the task lock
and the standalone :class:`~celery_redislock.lock.RedisLock` hold one.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from celery_redislock._process import current_pid
from celery_redislock.abort import withdraw_abort
from celery_redislock.exceptions import LockBackendError
from celery_redislock.leasing import Lease, report_lost
from celery_redislock.outcomes import ReleaseOutcome
from celery_redislock.renewer import native_lock, renewer
from celery_redislock.store import LockStore

__all__ = ["LockHandle", "release_completely", "report_lost"]

# The logger keeps the name the docs document (the module was lock.py).
logger = logging.getLogger("celery_redislock.lock")


def _dropped_while_held(pid: int, backend: LockStore, key: str, value: str, ttl: float) -> None:
    """Finalizer of a scoped handle dropped before its release ran.

    Only in the process that acquired it: a forked child inherits the handle
    (and this finalizer) but never owned the lock.
    """
    if current_pid() == pid:
        renewer().abandon(backend, key, value, ttl)


class LockHandle(Lease):
    """One acquisition of a lock, from grant to release.

    It is what a running task sees as ``self.lock``. The token (the whole
    stored value) lives on this object, never in thread-local storage, so the
    renewer thread and the task's thread act on the same acquisition.

    Attributes:
        key: Redis key of the lock.
        value: The exact value stored under ``key`` by this acquisition.
        ttl: Time to live in seconds; renewed every ``ttl / 3``.
        task_name: Name of the task (or the lock name outside Celery).
        task_id: Task id, or ``None`` outside a task.
        fence: Fencing token of this acquisition: strictly larger than every
            earlier acquisition's of the same key (see ``fencing.py``).
            Issued on its first read (one round trip): a holder that never
            reads it costs the lock store nothing for it.
        fenced: True once a fence was issued to this acquisition: its
            renewals and its release then look after the key's counter.
        lost_reason: Why the lock was lost (``"gone"``, ``"stolen"``,
            ``"expired_locally"``), or ``None`` while it is held.
    """

    backend: LockStore

    def __init__(
        self,
        backend: LockStore,
        key: str,
        value: str,
        ttl: float,
        granted_at: float,
        *,
        task_name: str,
        task_id: str | None,
        sender: Any,
        renew: bool = True,
        fence: int | None = None,
    ) -> None:
        super().__init__(backend, key, value, ttl, granted_at, task_name, task_id, sender, fence)
        #: True once the execution holding it has ended: no abort may reach it.
        self.finished = False
        #: Taken by whoever sends an abort and by :meth:`finish`, so an abort
        #: is either sent before the execution ends, or never.
        self.abort_guard = native_lock()
        #: Thread an asynchronous abort was sent to (lock_on_lost="abort").
        self.abort_sent_to: int | None = None
        self._renewing = False
        self._dropped: weakref.finalize[Any, Any] | None = None
        if renew:
            self.start_renewal()

    def start_renewal(self, scoped: bool = False) -> None:
        """Hand the lock to the process's renewer.

        Callers that must never leave a renewed lock behind construct the
        handle with ``renew=False``, store it where their cleanup will find
        it, and only then call this: an exception landing in between leaves
        nothing registered.

        Args:
            scoped: The renewer holds the handle weakly: once nothing else
                references it (its release was skipped), renewal stops and
                the value is taken back. For locks held by a ``with`` block.
        """
        if not self._renewing and not self.released:
            self._renewing = True
            if scoped:
                dropped = weakref.finalize(
                    self,
                    _dropped_while_held,
                    current_pid(),
                    self.backend,
                    self.key,
                    self.value,
                    self.ttl,
                )
                dropped.atexit = False  # at exit the TTL frees it; no thread to take it back
                self._dropped = dropped
            renewer().register(self, scoped=scoped)

    def _named(self) -> tuple[str, tuple[Any, ...]]:
        return "lock %s of %s[%s]", (self.key, self.task_name, self.task_id)

    @property
    def fence(self) -> int:
        """The fencing token of this acquisition, issued on first read (see the class).

        Raises:
            LockNotOwned: the lock is no longer held (released, or lost).
            LockBackendError: Redis is unreachable.
        """
        fence = self._known_fence()
        if fence is None:
            fence = self._fence_issued(self.backend.fence(self.key, self.value))
        return fence

    def _renewal_moved(self) -> None:
        if self._renewing:
            renewer().register(self, scoped=self._dropped is not None)
            if self.released or self.lost:
                # Released or lost meanwhile (in another thread), after its
                # unregister: take it out again (review helper-55 F2).
                renewer().unregister(self)

    def _stop_renewal(self) -> None:
        # Lost: the value is gone.
        renewer().unregister(self)
        self._renewing = False
        if self._dropped is not None:
            self._dropped.detach()  # the value is gone: nothing to take back

    def extend(self, ttl: float | None = None) -> None:
        """Reset the lock's TTL now (to ``ttl`` seconds, default the lock's TTL).

        Raises:
            LockNotOwned: the lock is no longer ours (it is marked lost).
            LockBackendError: Redis is unreachable.
        """
        sent_at = self._extending(ttl)
        outcome = self.backend.extend(self.key, self.value, self.ttl_ms, self.fenced)
        self._extended(outcome, sent_at)

    def finish(self) -> None:
        """Mark the execution that holds this lock as ended; withdraw an undelivered abort.

        After this returns, no :class:`LockLost` can be raised for this lock:
        the renewer sends an abort only under :attr:`abort_guard` and only
        before ``finished`` is set. Call it from the thread that holds the lock.
        """
        with self.abort_guard:
            self.finished = True
            withdraw_abort(self)

    def release(self, keep: str | None = None, keep_for: float = 0.0) -> ReleaseOutcome | None:
        """Release the lock; never raises a Redis error.

        The handle leaves the renewer *before* the release is sent, so a
        renewal can never outlive it. Calling it again after it completed is
        harmless; calling it again after an exception interrupted it (a soft
        time limit, an abort, ``KeyboardInterrupt``) sends the release again.

        Args:
            keep: Instead of deleting the key, leave this value in it for
                ``keep_for`` seconds: an idempotency window (a kept value,
                see ``tokens.py``) or a queued retry's value (the lock is
                handed over to that retry).
            keep_for: Seconds to keep ``keep``.

        Returns:
            What Redis found, or ``None`` if nothing was sent (already
            released, another process, or Redis unreachable: the TTL then
            frees the lock).
        """
        if not self._may_release():
            return None
        self.finish()
        self.released = True
        if self._renewing:
            renewer().unregister(self)
            self._renewing = False
        if self._dropped is not None:
            self._dropped.detach()  # this release takes care of the value
        # A release sent again after an exception cut off the first one's
        # reply: "already gone" then means the first one worked.
        resent, self._release_sent = self._release_sent, True
        try:
            if keep is None:
                outcome = self.backend.release(
                    self.key, self.value, fenced=self.fenced, resent=resent
                )
            else:
                outcome = self.backend.release(
                    self.key, self.value, keep, max(int(keep_for * 1000), 1), self.fenced, resent
                )
        except LockBackendError as exc:
            self._release_failed(exc)
            return None
        self._report_release(outcome, kept=keep is not None, resent=resent)
        return outcome


def release_completely(release: Callable[[], Any]) -> None:
    """Run a resumable release to its end even if one exception interrupts it.

    A soft time limit, an abort or a SIGTERM-born ``SystemExit`` can land in
    the middle of a release (each fires once). The release is then sent
    again, and the interruption re-raised once it is done: it is deferred,
    never swallowed.
    """
    try:
        release()
    except BaseException:
        release()
        raise
