"""The worker's sweep: publish the pending calls that nobody else will.

Runs in every worker's main process, in a thread of its own (a frozen lock
store must never stall the consumer's event loop), every
``redislock_sweep_interval`` seconds. Each tick claims the members of the
app's pending index that are due (``pending.py``): one ``EVALSHA`` when
nothing is, however many keys the store holds. For each due member it

* hands a free slot to the first call parked on the key, when the holder
  that would have done so is gone (its worker died, or a kept value
  expired), and publishes that call;
* publishes a copy of a coalesced or debounced run that has not started
  a while after it should have (its message died with the worker that
  reserved it): after a grace (the lock TTL, at most half the enqueue TTL),
  then after twice that, and so on, five copies at most;
* publishes a re-send the broker refused earlier (the outbox), once.

So no such call waits for the broker to give a dead worker's messages
back (the Redis broker does after its visibility timeout: an hour by
default). A copy that meets the original later runs once: the first copy
granted the lock marks the call ran, and the others are dropped.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import bootsteps
from celery.signals import worker_init

from celery_redislock.exceptions import ConfigurationError, LockBackendError
from celery_redislock.handoff import (
    app_pending,
    copy_kind,
    marker_ttl_ms,
    publish_copy,
    unpack_message,
)
from celery_redislock.pending import OUTBOX_TTL_MS, Member, PendingIndex, Reaped, Reaping
from celery_redislock.settings import AppSettings, app_settings
from celery_redislock.startup import uses_redislock

__all__ = ["Sweep", "Sweeper"]

logger = logging.getLogger("celery_redislock.sweeper")

#: Members looked at per tick, at most (the rest wait for the next tick).
BATCH = 100
#: How long a member one worker claimed is left alone by the others, in ms:
#: longer than a tick takes, short beside a lock TTL (a worker that dies
#: mid-tick delays its claimed members by this much).
LEASE_MS = 2_000
#: How soon a message that could not be published is tried again, in ms.
PUBLISH_RETRY_MS = 5_000


class Sweeper:
    """One worker's sweep of ``app``'s pending calls (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        #: Set while the store fails, so a long outage logs once, not per tick.
        self._failing = False

    def tick(self) -> None:
        """Sweep once; never raises."""
        try:
            self.sweep()
        except LockBackendError as exc:
            if not self._failing:
                logger.warning("celery-redislock: sweep failed, trying again: %s", exc)
            self._failing = True
            return
        except Exception:
            logger.exception("celery-redislock: sweep failed")
            return
        self._failing = False

    def sweep(self) -> int:
        """Look at every due member once; return how many there were.

        Raises:
            LockBackendError: the lock store failed (the tick is abandoned;
                members claimed are looked at again when their lease ends).
        """
        settings = app_settings(self.app)
        index = app_pending(self.app, settings.backend, settings.key_prefix)
        claim, members = index.due(BATCH, LEASE_MS)
        for member in members:
            try:
                kind, name, detail = Member.parse(member)
            except ValueError:
                index.settle(member, claim, None)
                continue
            index.settle(member, claim, self._look_at(index, settings, kind, name, detail))
        return len(members)

    def _look_at(
        self, index: PendingIndex, settings: AppSettings, kind: str, name: str, detail: str
    ) -> int | None:
        """Act on one member; return in how many ms to look again (None: done).

        ``name`` is the lock key (or the outbox id), ``detail`` the key's
        slots (parked calls) or the run's task id (queued).
        """
        store = settings.backend
        ran_ttl_ms = marker_ttl_ms(self.app.conf, settings.enqueue_ttl, settings.ttl)
        if kind == Member.OUTBOX:
            return self._publish_outbox(index, name)
        reaped: Reaped
        if kind == Member.PARKED:
            reaped = index.reap_parked(name, int(detail), store.handoff_ttl_ms, store.fence_ttl_ms)
            what, again_ms = "its holder is gone", store.handoff_ttl_ms
        elif kind == Member.QUEUED:
            reaped = index.reap_queued(name, detail, ran_ttl_ms)
            what, again_ms = "its queued run has not started", 0
        else:
            reaped = index.reap_debounced(name, ran_ttl_ms)
            what, again_ms = "its debounced run has not started", 0
        if reaped.outcome is Reaping.DONE:
            return None
        if reaped.outcome is Reaping.LATER:
            return reaped.later_ms
        try:
            signature = publish_copy(self.app, reaped.message, "r")
        except Exception:
            logger.exception(
                "celery-redislock: could not publish a pending call of lock %s (%s)", name, what
            )
            return PUBLISH_RETRY_MS
        logger.warning(
            "celery-redislock: published %s[%s] for lock %s: %s",
            signature.task,
            signature.options.get("task_id"),
            name,
            what,
        )
        # Queued and debounced runs: the record says when the next copy is due.
        return again_ms

    def _publish_outbox(self, index: PendingIndex, message_id: str) -> int | None:
        message = index.take_outbox(message_id)
        if message is None:
            return None  # another sweep took it
        try:
            kind = copy_kind(message)
            if kind is None:  # a lock retry: Celery's own publish
                signature = self.app.signature(unpack_message(message))
                signature.apply_async()
            else:  # a copy of a parked call: a tag of its own each time
                signature = publish_copy(self.app, message, kind)
        except Exception as exc:
            index.put_outbox(message_id, message, PUBLISH_RETRY_MS, OUTBOX_TTL_MS)
            logger.warning(
                "celery-redislock: the broker still refuses a kept re-send (%s); "
                "trying again in %.1fs",
                exc,
                PUBLISH_RETRY_MS / 1000,
            )
            return None
        logger.warning(
            "celery-redislock: published the kept re-send of %s[%s]",
            signature.task,
            signature.options.get("task_id"),
        )
        return None


class _SweepThread:
    """Ticks a :class:`Sweeper` every ``interval`` seconds in a daemon thread.

    A thread, not the consumer's timer: a frozen lock store costs each tick
    up to twice the renewal timeout, which must not stall the consumer. No
    fork happens in the middle of a tick (a prefork worker forks its pool
    children from this process): ``os.register_at_fork`` waits for the tick.
    """

    def __init__(self, sweeper: Sweeper, interval: float) -> None:
        self.sweeper = sweeper
        self.interval = interval
        self.stopped = threading.Event()
        self.ticking = threading.Lock()
        self.held_for_fork = False
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name="redislock-sweep", daemon=True)
        os.register_at_fork(
            before=self._before_fork,
            after_in_parent=self._after_fork,
            after_in_child=self._after_fork,
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _before_fork(self) -> None:
        if not self.stopped.is_set() and os.getpid() == self.pid:
            self.ticking.acquire()
            self.held_for_fork = True

    def _after_fork(self) -> None:
        if self.held_for_fork:
            self.held_for_fork = False
            self.ticking.release()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            with self.ticking:
                if self.stopped.is_set() or os.getpid() != self.pid:
                    return
                self.sweeper.tick()


class Sweep(bootsteps.StartStopStep):
    """Consumer bootstep: sweep the pending calls while the consumer runs."""

    name = "celery_redislock.sweeper.Sweep"
    label = "celery-redislock sweep"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self.running: _SweepThread | None = None
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        """Start sweeping every ``redislock_sweep_interval`` seconds (if this app locks)."""
        app = parent.app
        if not uses_redislock(app):
            return
        try:
            interval = app_settings(app).sweep_interval
        except ConfigurationError:
            return  # the start-up check already stopped the worker, or will
        if interval > 0:
            self.running = _SweepThread(Sweeper(app), interval)
            self.running.start()

    def stop(self, parent: Any) -> None:
        """Stop sweeping."""
        if self.running is not None:
            self.running.stop()
            self.running = None

    shutdown = stop


@worker_init.connect(weak=False)
def _add_sweep(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        app.steps["consumer"].add(Sweep)
