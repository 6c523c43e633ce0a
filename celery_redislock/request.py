"""Everything that runs in the worker's parent process: the pool child's lock backstop.

When a pool child dies holding a lock (SIGKILL, OOM, a hard time limit,
revoke with ``terminate``), :class:`SingletonRequest` releases it by owner
prefix (task id, attempt, node, pid: see ``tokens.py``), which can never
match a later attempt, and only once the child has exited. A task revoked
or expired before it started frees its enqueue-time key (``revoked.py``).
A whole worker killed at once is covered by the TTL, which renewal keeps
alive only while the holder lives, or, when it restarts under the same node
name, by its start (``recovery.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal as signals_module
import time
from typing import Any, NamedTuple

from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.platforms import signals as _signals
from celery.worker.request import Request

from celery_redislock._clock import clock
from celery_redislock.handoff import RECEIVED_CONTENT_TYPE
from celery_redislock.headers import QUEUED_TOKEN_HEADER
from celery_redislock.revoked import release_queued_lock, release_revoked_queued_lock
from celery_redislock.settings import TaskSettings
from celery_redislock.store import ReleaseOutcome
from celery_redislock.task import SingletonTaskMixin
from celery_redislock.tokens import LockOwner

__all__ = [
    "SingletonRequest",
    "release_queued_lock",
    "release_revoked_queued_lock",
]

# The documented logger name: the parent side was part of task.py.
logger = logging.getLogger("celery_redislock.task")

#: Longest wait for a SIGKILLed pool child to exit before its lock is released.
_KILLED_EXIT_WAIT = 5.0
#: Signals a billiard child turns into SystemExit (its ``finally`` releases the
#: lock), and the longest wait for that release before REVOKED is deferred to
#: the child's exit. SIGINT is ignored by children.
_STOPPING_SIGNALS = (signals_module.SIGTERM, signals_module.SIGQUIT, signals_module.SIGHUP)
_STOPPING_RELEASE_WAIT = 1.0
#: billiard's grace between SIGTERM and SIGKILL at a hard time limit.
_HARD_LIMIT_GRACE = 0.1


class SingletonRequest(Request):
    """Worker request that releases a pool child's lock from the parent, once the child exited.

    billiard calls the failure handler of a hard time limit *before* it
    kills the child, and Celery stores REVOKED right after sending
    ``terminate``'s signal: a release at those moments would let a
    duplicate start while the child still runs. So the parent ends the
    child (as billiard is about to) or waits for it to exit, and releases
    only then, before Celery stores the outcome: ``result.get()`` returning
    means the lock is free.
    """

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        # The serializer the call was sent with: a re-send (parked, lock
        # retry) uses it too, not the task's (which may refuse the arguments).
        # Read from the message: Celery keeps none for one it decoded (protocol 1).
        self.request_dict[RECEIVED_CONTENT_TYPE] = getattr(message, "content_type", None)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """A hard time limit: end the child, then release its lock."""
        if not soft:
            self._release_after_exit("hard time limit", kill=True)
        super().on_timeout(soft, timeout)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        """The child died (WorkerLostError, terminated) or hit its hard time limit."""
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # unwrap billiard's ExceptionWithTraceback
        if isinstance(exc, TimeLimitExceeded):
            self._release_after_exit("hard time limit", kill=True)
        elif isinstance(exc, (WorkerLostError, Terminated)):
            self._release_child_lock(type(exc).__name__, self._will_be_resent(exc))
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    #: Set when a terminated child has not released its lock in time: Celery's
    #: REVOKED is then announced when the child has exited (``Terminated``).
    _redislock_defer_revoked = False

    #: A terminate's stopping signal (or gevent kill) was sent; its REVOKED
    #: waits for the cleanup.
    _redislock_terminating = False
    #: Under gevent: a greenlet announces REVOKED once the killed one ended.
    _redislock_announcer = False

    def terminate(self, pool: Any, signal: Any = None) -> None:
        """``revoke(terminate=True)``: REVOKED only once the child's lock is released."""
        signum = _signals.signum(signal or "TERM")
        if self._redislock_terminating and signum != signals_module.SIGKILL:
            # Revoked again while the first terminate's REVOKED waits for the
            # cleanup (Celery would have forgotten the request by now): a
            # second signal would cut that cleanup, or its release, short.
            # Only SIGKILL goes on, the escalation a stuck cleanup needs.
            return
        gevent_pool = type(pool).__module__ == "celery.concurrency.gevent"
        stopping = self.time_start and (gevent_pool or signum in _STOPPING_SIGNALS)
        if self.time_start and gevent_pool:
            pool = _ReleaseAfterKill(pool, self)
        super().terminate(self._releasing(pool), signal)  # threads, solo: raises, sends nothing
        # Not after a signal the body may survive (SIGUSR1): a stronger one
        # may follow. Nor once REVOKED is stored (the request is done).
        self._redislock_terminating = bool(stopping) and not getattr(
            self, "_already_revoked", False
        )

    def _announce_revoked(self, reason: Any, terminated: Any, signum: Any, expired: Any) -> None:
        # Celery announces REVOKED right after sending terminate's signal, and
        # again (unless already announced) when billiard reports the child
        # ``Terminated``, which it does once the child has exited. While the
        # child still holds its lock, the first announcement is held back.
        if self._redislock_defer_revoked:
            self._redislock_defer_revoked = False
            return
        try:
            if not terminated:
                # Given back before REVOKED is stored (Celery sends task_revoked
                # after): a call made once the result says REVOKED is published,
                # not joined to this run. The signal's give-back is then skipped
                # (not if an interruption cut this one short).
                context = self._context  # type: ignore[attr-defined]
                release_revoked_queued_lock(sender=self.task, request=context)
                context.redislock_given_back = True
        finally:
            super()._announce_revoked(reason, terminated, signum, expired)  # type: ignore[misc]

    def cancel(self, pool: Any, signal: Any = None, emit_retry: bool = True) -> None:
        """Cold shutdown: release once the signalled child has exited."""
        super().cancel(self._releasing(pool), signal, emit_retry=emit_retry)

    def _releasing(self, pool: Any) -> Any:
        if self.time_start and _is_running_child(self.worker_pid):
            return _ReleaseAfterExit(pool, self)
        return pool

    def _will_be_resent(self, exc: BaseException) -> bool:
        """Whether Celery puts this message back (so its key should wait for it).

        Mirrors ``celery.worker.request.Request.on_failure``: a lost worker is
        re-sent with ``retry_on_worker_lost`` while retries remain, or
        requeued with ``acks_late`` and ``reject_on_worker_lost``.
        """
        if not isinstance(exc, WorkerLostError):
            return False
        task = self.task
        if getattr(task, "retry_on_worker_lost", False):
            retries = int(self.request_dict.get("retries") or 0)
            max_retries = task.max_retries
            return max_retries is None or retries < max_retries
        return bool(task.acks_late and task.reject_on_worker_lost)

    def _release_after_exit(self, reason: str, kill: bool) -> None:
        pid = self.worker_pid
        if isinstance(pid, int) and _is_running_child(pid):
            if kill:
                # What billiard does right after this handler: SIGTERM, a
                # 0.1 s grace for the child's own finally, then SIGKILL.
                _signal(pid, signals_module.SIGTERM)
                if not _exited(pid, _HARD_LIMIT_GRACE):
                    _signal(pid, signals_module.SIGKILL)
            if not _exited(pid, _KILLED_EXIT_WAIT):
                logger.error(
                    "%s[%s]: pool process %s is still running after %s; its lock %s",
                    self.name,
                    self.id,
                    pid,
                    reason,
                    "is left to its own release or its TTL",
                )
                return
        self._release_child_lock(reason)

    def _child_lock(self) -> _ChildLock | None:
        """The lock this request's execution took in its pool child (None: it takes none).

        Its owner (task id, attempt, node, pid) is that of exactly this
        attempt in exactly that process; the key is computed from the
        message's arguments, as the child received them.
        """
        task = self.task
        if not isinstance(task, SingletonTaskMixin):
            return None
        settings = task.lock_settings()
        if not settings.enabled:
            return None
        owner = LockOwner(
            self.id,
            int(self.request_dict.get("retries") or 0),
            self.hostname,
            int(self.worker_pid) if self.worker_pid else None,
        )
        key = task.lock_key_for_received(self.args, self.kwargs, settings)
        return _ChildLock(task, settings, key, owner)

    def _wait_for_child_release(self, timeout: float) -> bool:
        """Wait for the signalled child's own ``finally`` to release its lock.

        Not for its exit: a billiard child exits only once this (the parent's)
        event loop runs again (measured: its key was free after 23 ms, its
        exit came when a 1 s wait for it ended). Woken by the release
        notification, not by polling.
        """
        try:
            lock = self._child_lock()
            released = lock is None or lock.settings.backend.wait_released(
                lock.key, lock.owner.prefix(), timeout, lock.settings.limit
            )
        except Exception:
            logger.exception("could not watch the lock of %s[%s]", self.name, self.id)
            return False
        if not released:
            logger.warning(
                "%s[%s]: pool process %s still holds its lock %.1fs after the signal; "
                "REVOKED is stored once the process has exited",
                self.name,
                self.id,
                self.worker_pid,
                timeout,
            )
        return released

    def _announce_once_ended(self, greenlet: Any, signum: Any) -> None:
        """Under gevent: store REVOKED once the killed greenlet has ended (its release done).

        Also after one that survived the kill and ran on to its end, as
        Celery does (which announces at the kill); its result backend keeps
        a SUCCESS stored first.
        """
        try:
            greenlet.join()
        finally:
            if not getattr(self, "_already_revoked", False):
                super()._announce_revoked("terminated", True, signum, False)  # type: ignore[misc]

    def _release_child_lock(self, reason: str, requeued: bool = False) -> None:
        """Release the lock of this execution, whose process has ended.

        Matches on the owner prefix, so it releases only the lock taken by
        exactly this attempt in exactly that process. When the message goes
        back to the queue (``retry_on_worker_lost``, or ``acks_late`` with
        ``reject_on_worker_lost``) and carries a queued token, the key is
        handed to that token instead, for the redelivered message.
        """
        try:
            lock = self._child_lock()
            if lock is None:
                return
            settings, store, prefix = lock.settings, lock.settings.backend, lock.owner.prefix()
            headers = self.request_dict.get("headers") or {}
            token = headers.get(QUEUED_TOKEN_HEADER) or self.request_dict.get(QUEUED_TOKEN_HEADER)
            if requeued and token and settings.enqueue and not settings.coalesce:
                ttl = settings.enqueue_ttl + float(lock.task.default_retry_delay or 0)
                store.release_owner(lock.key, prefix, token, int(ttl * 1000))
                return
            if _release_owner(lock, prefix) is ReleaseOutcome.RELEASED:
                logger.warning(
                    "released lock %s of %s[%s] attempt %d after its process %s ended "
                    "abnormally (%s)",
                    lock.key,
                    self.name,
                    self.id,
                    lock.owner.attempt,
                    lock.owner.pid,
                    reason,
                )
        except Exception:
            logger.exception(
                "could not release the lock of %s[%s] (%s)", self.name, self.id, reason
            )


def _release_owner(lock: _ChildLock, prefix: str) -> ReleaseOutcome:
    """Release the dead child's lock by owner prefix; with ``lock_limit`` > 1, whichever slot."""
    store = lock.settings.backend
    if lock.settings.limit > 1:
        return store.release_slot_of(lock.key, lock.settings.limit, prefix, "prefix")
    return store.release_owner(lock.key, prefix)


class _ChildLock(NamedTuple):
    task: SingletonTaskMixin
    settings: TaskSettings
    key: str
    owner: LockOwner


class _ReleaseAfterExit:
    """A pool whose ``terminate_job`` returns once the child's lock is released, or defers.

    After SIGKILL: once the child has exited, the parent releases it. After
    a signal the child turns into ``SystemExit``: its own ``finally``
    releases, and the parent waits for that (bounded). If the bound passes
    first, Celery's REVOKED waits for the child's exit.
    """

    def __init__(self, pool: Any, request: SingletonRequest) -> None:
        self._pool = pool
        self._request = request

    def terminate_job(self, pid: int, signal: Any = None) -> None:
        self._pool.terminate_job(pid, signal)
        request = self._request
        signum = signals_module.Signals(signal or signals_module.SIGTERM)
        if signum is signals_module.SIGKILL:
            released = _exited(pid, _KILLED_EXIT_WAIT)
            if released:
                request._release_child_lock("terminated")
        elif signum in _STOPPING_SIGNALS:
            released = request._wait_for_child_release(_STOPPING_RELEASE_WAIT)
        else:
            # One the child may survive (SIGUSR1 raises SoftTimeLimitExceeded
            # in the body, which may go on holding the lock): no wait, which
            # would block this process's loop for every such revoke; one
            # look at the lock, and REVOKED only if it is free already.
            released = request._wait_for_child_release(0.0)
        # Not yet: REVOKED is announced when billiard reports the child's exit
        # (Terminated); a child that survived the signal ends its task
        # instead, releasing first, and its own outcome is stored.
        request._redislock_defer_revoked = not released

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class _ReleaseAfterKill:
    """The gevent pool: REVOKED is stored once the killed greenlet has ended.

    gevent kills the greenlet and returns at once: its ``finally`` (the
    body's own cleanup, then the lock's release) runs once this greenlet
    yields, after Celery stored REVOKED. So the announcement is deferred to a
    greenlet of its own that joins the killed one, however long its cleanup
    takes (as prefork's waits for the child's exit; a bound would store
    REVOKED with the key still held). Each revoked task waits on its own: a
    revoke of many kills them all at once, and the consumer goes on.
    Eventlet's pool waits for the greenlet itself.
    """

    def __init__(self, pool: Any, request: SingletonRequest) -> None:
        self._pool = pool
        self._request = request

    def terminate_job(self, pid: Any, signal: Any = None) -> None:
        import gevent  # type: ignore[import-untyped,unused-ignore]  # under the gevent pool only

        # Celery's gevent pool keeps each task's greenlet by its id (the "pid").
        greenlet = (getattr(self._pool, "_pool_map", None) or {}).get(pid)
        self._pool.terminate_job(pid, signal)
        if greenlet is not None and not greenlet.dead:
            request = self._request
            request._redislock_defer_revoked = True  # Celery's announcement, next
            if not request._redislock_announcer:  # once, however often it is killed
                request._redislock_announcer = True
                gevent.spawn(request._announce_once_ended, greenlet, signal)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _is_running_child(pid: Any) -> bool:
    """True if ``pid`` is a child process of this one that has not exited.

    False for the threads, solo and gevent pools, whose "pid" is this
    process (or a greenlet's id).
    """
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except (ChildProcessError, OverflowError, OSError):
        return False


def _exited(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for child ``pid`` to exit (left for billiard to reap)."""
    deadline = clock() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True  # already reaped by billiard
        if clock() >= deadline:
            return False
        time.sleep(0.001)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)
