"""What an operator sees and does: list held locks, find one, force-release it.

The ``celery redislock`` command (``cli.py``) is a thin shell over this
module, so the same operations are available from Python::

    inventory = LockInventory(app)
    for record in inventory.locks(task="proj.tasks.sync_account"):
        print(record.key, record.task_id, record.ttl_remaining)

Only keys under the app's ``redislock_key_prefix`` are listed, found with
``SCAN`` (never ``KEYS``, which blocks Redis). A standalone
:class:`~celery_redislock.RedisLock` uses the name you gave it and is not
listed.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from celery import Celery

from celery_redislock.key_family import split_slot
from celery_redislock.settings import AppSettings, TaskSettings, app_settings
from celery_redislock.store import ReleaseOutcome
from celery_redislock.tokens import KEPT_HOST, PARKED_HOST, QUEUED_HOST, LockValue

__all__ = ["LIVE_GRACE", "LockInventory", "LockRecord"]

logger = logging.getLogger("celery_redislock.admin")

#: Slack, in seconds, on top of the renewal interval (TTL/3) before a lock
#: counts as no longer renewed: the renewer's own jitter and round trip.
LIVE_GRACE = 1.0

#: What ``state`` says about a lock value.
HELD, QUEUED, UNKNOWN = "held", "queued", "unknown"


@dataclass(frozen=True)
class LockRecord:
    """One lock key as read from Redis.

    Attributes:
        key: The Redis key.
        value: The stored value, as is.
        state: ``"held"`` (by a worker: running, or kept after success
            as an idempotency window), ``"queued"`` (taken at
            enqueue time for a message not started yet) or ``"unknown"``
            (a value this package did not write).
        task_name: Task that took it, if known.
        task_id: Holder's task id, if known.
        attempt: Holder's retry count.
        hostname: Worker node of the holder.
        pid: Process that runs the holder's body.
        acquired_at: When it was taken (Unix seconds).
        ttl_remaining: Seconds until it expires unless renewed; ``None`` if
            it has no expiry.
        fence: The key's last fencing token (shared by all slots of a key).
        slot: Which slot of its key this is (``lock_limit``): 1 for the key
            itself, n for ``<key>:slot:<n>``. Each slot is its own record.
    """

    key: str
    value: str
    state: str
    task_name: str | None
    task_id: str | None
    attempt: int | None
    hostname: str | None
    pid: int | None
    acquired_at: float | None
    ttl_remaining: float | None
    fence: int | None
    slot: int = 1

    def age(self, now: float | None = None) -> float | None:
        """Seconds since the lock was taken, if known."""
        if self.acquired_at is None:
            return None
        return max((time.time() if now is None else now) - self.acquired_at, 0.0)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view, with the age computed now."""
        return {**asdict(self), "age": self.age()}

    @classmethod
    def parse(
        cls, key: str, value: str, ttl_remaining: float | None, fence: int | None
    ) -> LockRecord:
        """Build a record from what Redis returned for ``key``."""
        decoded = LockValue.decode(value)
        slot = split_slot(key)[1]
        if decoded is None:
            return cls(
                key, value, UNKNOWN, None, None, None, None, None, None, ttl_remaining, fence, slot
            )
        owner = decoded.owner
        queued = owner.hostname in (QUEUED_HOST, PARKED_HOST)
        return cls(
            key=key,
            value=value,
            state=QUEUED if queued else HELD,
            task_name=decoded.task_name or None,
            task_id=owner.task_id or None,
            attempt=owner.attempt,
            hostname=None if queued else owner.hostname,
            pid=owner.pid,
            acquired_at=decoded.acquired_ms / 1000.0,
            ttl_remaining=ttl_remaining,
            fence=fence,
            slot=slot,
        )


class LockInventory:
    """The locks of one Celery app, for listing and repair.

    Args:
        app: The app whose ``redislock_*`` settings name the lock store.

    Raises:
        ConfigurationError: the app's lock settings are unusable.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.settings: AppSettings = app_settings(app)

    @property
    def prefix(self) -> str:
        """Every lock key of this app starts with this and a colon."""
        return self.settings.key_prefix

    def _records(self) -> Iterator[LockRecord]:
        backend = self.settings.backend
        seen: set[str] = set()
        for batch in backend.scan_keys(_glob_escape(self.prefix) + ":*"):
            batch = [key for key in batch if key not in seen]
            seen.update(batch)
            for key, (value, ttl, fence) in zip(batch, backend.inspect_many(batch), strict=True):
                if value is not None:  # released between SCAN and GET
                    yield LockRecord.parse(key, value, ttl, fence)

    def locks(self, task: str | None = None) -> list[LockRecord]:
        """Every held lock (of ``task`` only, if given), oldest first.

        Raises:
            LockBackendError: Redis is unreachable.
        """
        records = [r for r in self._records() if task is None or r.task_name == task]
        return sorted(records, key=lambda r: (r.acquired_at is None, r.acquired_at or 0, r.key))

    def find(self, key_or_task_id: str) -> LockRecord | None:
        """The lock stored under this key, or else the one held by this task id.

        Raises:
            LockBackendError: Redis is unreachable.
        """
        if key_or_task_id.startswith(self.prefix + ":"):
            ((value, ttl, fence),) = self.settings.backend.inspect_many([key_or_task_id])
            return None if value is None else LockRecord.parse(key_or_task_id, value, ttl, fence)
        return next((r for r in self._records() if r.task_id == key_or_task_id), None)

    def ttl_for(self, record: LockRecord) -> float | None:
        """The lock TTL configured for the record's task; ``None`` for a task the app lacks."""
        task = self.app.tasks.get(record.task_name or "") if record.task_name else None
        if task is None:
            return None
        settings = TaskSettings.merge(task, self.settings)
        return settings.enqueue_ttl if record.state == QUEUED else settings.ttl

    def is_live(self, record: LockRecord) -> bool:
        """Whether a running holder may still be renewing this lock.

        The renewer resets a held lock's TTL every TTL/3. A lock whose
        remaining TTL shows it has gone longer than that (plus
        :data:`LIVE_GRACE`) without a reset has a holder that died or
        stalled. A lock taken or renewed within that interval cannot be told
        apart from a live one and counts as live, and so does an idempotency
        window (``lock_hold_after_success``), and a lock of a task the app
        does not know (its TTL is unknown: any remaining TTL may be a renewed
        lock's). Queued keys are renewed by nobody and are never live.
        """
        if record.state != HELD or record.ttl_remaining is None:
            return False
        ttl = self.ttl_for(record)
        if ttl is None or record.hostname == KEPT_HOST:
            return True
        return ttl - record.ttl_remaining <= ttl / 3 + LIVE_GRACE

    def release(self, record: LockRecord, *, log: bool = True) -> ReleaseOutcome:
        """Delete the lock if it still holds the value read into ``record``.

        Waiters are woken as by a normal release. If the lock changed hands
        since it was read, it is left alone and ``NOT_OURS`` is returned.

        Args:
            record: The lock as read by :meth:`locks` or :meth:`find`.
            log: Log the release at WARNING (``force-released ...``); a
                caller that logs its own line passes False.

        Raises:
            LockBackendError: Redis is unreachable.
        """
        # fenced: the holder may have read a fence; its counter is settled as
        # the holder's own release would (never left to outlive the clock).
        outcome = self.settings.backend.release(record.key, record.value, fenced=True)
        if log and outcome is ReleaseOutcome.RELEASED:
            logger.warning(
                "force-released lock %s (task %s, holder %s on %s pid %s)",
                record.key,
                record.task_name,
                record.task_id,
                record.hostname,
                record.pid,
            )
        return outcome


def _glob_escape(text: str) -> str:
    """Escape SCAN MATCH's glob characters in a literal prefix."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
