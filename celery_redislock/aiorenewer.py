"""One renewer task per event loop keeps all of that loop's held asyncio locks alive.

Every TTL/3, in one round trip per store per tick. The task exists only
while the loop holds a lock, and a loop shut down by ``asyncio.run``
cancels it like any other task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import weakref

from celery_redislock._clock import clock
from celery_redislock.aiostore import AsyncLockStore
from celery_redislock.aiotransport import async_timeout
from celery_redislock.leasing import (
    Renewable,
    due_for_renewal,
    renewal_failed,
    renewal_replied,
)

__all__ = ["AsyncRenewer", "async_renewer"]

# The renewer's documented logger name.
renewal_logger = logging.getLogger("celery_redislock.renewal")


class AsyncRenewer:
    """Keeps one event loop's held locks (each an ``AsyncLockHandle``) alive from one task.

    The task starts with the first registration and ends when nothing is
    held, so an idle loop has no task of ours to cancel or leak.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._handles: dict[int, Renewable] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        #: Number of renewal round trips made (for tests and benchmarks).
        self.round_trips = 0

    @property
    def held(self) -> int:
        """Number of locks this loop keeps alive."""
        return len(self._handles)

    @property
    def alive(self) -> bool:
        """True while the renewer task runs."""
        return self._task is not None and not self._task.done()

    def register(self, handle: Renewable) -> None:
        """Start keeping ``handle`` alive (starts the task if needed)."""
        self._forget_parents_locks()
        self._handles[id(handle)] = handle
        if not self.alive:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="redislock-async-renewer"
            )
        elif self._wake is not None:
            self._wake.set()

    def unregister(self, handle: Renewable) -> None:
        """Stop renewing ``handle``; a reply in flight for it is ignored."""
        self._handles.pop(id(handle), None)
        if not self._handles and self._wake is not None:
            self._wake.set()  # nothing left: let the task end now, not at its next tick

    async def _run(self) -> None:
        wake = self._wake
        try:
            while self._handles and wake is not None:
                try:
                    sleep = await self._tick()
                except Exception:
                    renewal_logger.exception("async lock renewal tick failed; continuing")
                    sleep = 0.1
                if not self._handles:
                    return
                wake.clear()
                # Not asyncio.wait_for: before Python 3.12 it drops a cancel
                # that lands with the wake-up (see aiotransport._send_packed_command).
                with contextlib.suppress(asyncio.TimeoutError):
                    async with async_timeout(max(sleep, 0.0)):
                        await wake.wait()
        finally:
            # Cancelled (the loop is shutting down) or nothing held: a later
            # registration starts a new task. No await in between, so none
            # can register in the gap.
            self._task = self._wake = None

    def _forget_parents_locks(self) -> None:
        # A child forked while the loop ran goes on running it: it must
        # never renew its parent's locks.
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()

    async def _tick(self) -> float:
        self._forget_parents_locks()
        now = clock()
        groups: dict[AsyncLockStore, list[Renewable]] = {}
        for handle in due_for_renewal(list(self._handles.values()), now):
            groups.setdefault(handle.backend, []).append(handle)
        for store, handles in groups.items():
            await self._renew_group(store, handles)
        pending = [h.renew_at for h in self._handles.values()]
        return min(pending) - clock() if pending else 0.0

    async def _renew_group(self, store: AsyncLockStore, handles: list[Renewable]) -> None:
        sent_at = clock()
        try:
            self.round_trips += 1
            outcomes = await store.renew_many([h.renewal_item(sent_at) for h in handles])
        except Exception as exc:
            renewal_failed(handles, exc, renewal_logger)
            return
        renewal_replied(handles, outcomes, sent_at, lambda handle: id(handle) in self._handles)


_RENEWERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncRenewer] = (
    weakref.WeakKeyDictionary()
)


def async_renewer() -> AsyncRenewer:
    """Return the running event loop's renewer."""
    loop = asyncio.get_running_loop()
    found = _RENEWERS.get(loop)
    if found is None:
        found = _RENEWERS[loop] = AsyncRenewer()
    return found
