"""A held asyncio lock: :class:`AsyncLockHandle`, from grant to release.

The asyncio twin of ``LockHandle``: the same lease, renewed by its event
loop's renewer task, released awaited.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_redislock.aiorenewer import AsyncRenewer, async_renewer
from celery_redislock.aiostore import AsyncLockStore
from celery_redislock.exceptions import LockBackendError
from celery_redislock.leasing import Lease
from celery_redislock.outcomes import ReleaseOutcome

__all__ = ["AsyncLockHandle"]

# The standalone lock's documented logger name.
logger = logging.getLogger("celery_redislock.lock")


class AsyncLockHandle(Lease):
    """One acquisition of an :class:`AsyncRedisLock`, from grant to release.

    Attributes:
        key: Redis key of the lock.
        value: The exact value stored under ``key`` by this acquisition.
        ttl: Time to live in seconds; renewed every ``ttl / 3``.
        fenced: True once a fence was issued to this acquisition
            (:meth:`fence`): its renewals and release then settle the counter.
        lost_reason: ``"gone"``, ``"stolen"`` or ``"expired_locally"`` once lost.
    """

    backend: AsyncLockStore

    def __init__(
        self,
        store: AsyncLockStore,
        key: str,
        value: str,
        ttl: float,
        granted_at: float,
        *,
        sender: Any,
        fence: int | None,
    ) -> None:
        super().__init__(store, key, value, ttl, granted_at, key, None, sender, fence)
        self._renewer: AsyncRenewer | None = None

    async def fence(self) -> int:
        """The fencing token of this acquisition, issued on first call (one round trip).

        Strictly larger than every earlier acquisition's of the same key; a
        holder that never asks costs the lock store nothing for it.

        Raises:
            LockNotOwned: the lock is no longer held (released, or lost).
            LockBackendError: Redis is unreachable.
        """
        fence = self._known_fence()
        if fence is None:
            fence = self._fence_issued(await self.backend.fence(self.key, self.value))
        return fence

    def start_renewal(self) -> None:
        """Hand the lock to the running loop's renewer task."""
        if self._renewer is None and not self.released:
            self._renewer = async_renewer()
            self._renewer.register(self)

    def _renewal_moved(self) -> None:
        renewer = self._renewer
        if renewer is not None:
            renewer.register(self)
            if self.released or self.lost:  # see LockHandle._renewal_moved
                renewer.unregister(self)

    def _stop_renewal(self) -> None:
        if self._renewer is not None:
            self._renewer.unregister(self)
            self._renewer = None

    async def extend(self, ttl: float | None = None) -> None:
        """Reset the lock's TTL now (to ``ttl`` seconds, default the lock's TTL).

        Raises:
            LockNotOwned: the lock is no longer ours (it is marked lost).
            LockBackendError: Redis is unreachable.
        """
        sent_at = self._extending(ttl)
        outcome = await self.backend.extend(self.key, self.value, self.ttl_ms, self.fenced)
        self._extended(outcome, sent_at)

    async def release(self) -> ReleaseOutcome | None:
        """Release the lock; never raises a Redis error (see ``LockHandle.release``).

        Renewal stops before the release is sent. Awaiting it again after a
        cancellation cut it off sends it again.
        """
        if not self._may_release():
            return None
        self.released = True
        self._stop_renewal()
        resent, self._release_sent = self._release_sent, True
        try:
            outcome = await self.backend.release(self.key, self.value, self.fenced, resent)
        except LockBackendError as exc:
            self._release_failed(exc)
            return None
        self._report_release(outcome, resent=resent)
        return outcome
