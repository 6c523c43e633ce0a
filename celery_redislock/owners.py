"""Who owns a reentrant lock, and how deep its owner is in it.

A reentrant lock is owned by a thread (:class:`~celery_redislock.RedisLock`)
or by an asyncio task (:class:`~celery_redislock.AsyncRedisLock`). Redis holds
one plain value per *outermost* acquisition, in the format of every other
lock (so renewal, listing, the CLI and fencing see an ordinary lock); the
nesting depth is counted here, in the owner's process, and changed only by
the owner itself. A nested acquire confirms the value is still ours (it
extends the lock); only the last release sends the release script.

Counting in the process rather than in a Redis hash keeps every Redis call
idempotent: a call whose reply was lost is sent again by the transport, and
an ``HINCRBY`` counted twice would keep the key for ever, or one counted
down twice would free it under a holder that still runs.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Hold", "Holds", "task_owner", "thread_owner"]

H = TypeVar("H")


# One thread-local object per ``threading.local`` class: the class is looked
# up at each call, not bound at import, because the package may be imported
# before gevent patches ``threading`` (gunicorn --preload): a native
# thread-local would then be shared by every greenlet of the thread, and all
# of them would own each other's locks. The same reason as takeback.py's.
_LOCALS: dict[type, Any] = {}


def _thread_token() -> object:
    """A token per thread (per greenlet once gevent patched threading), never reused."""
    local_class = threading.local
    local = _LOCALS.get(local_class)
    if local is None:
        local = _LOCALS.setdefault(local_class, local_class())
    token = getattr(local, "token", None)
    if token is None:
        token = local.token = object()
    return token


_TASKS: weakref.WeakKeyDictionary[asyncio.Task[Any], object] = weakref.WeakKeyDictionary()


def thread_owner() -> object:
    """The owner token of the calling thread (unlike a thread id, never reused).

    Inside a running asyncio task it is that task's token instead: every
    coroutine of an event loop runs on one thread, and a sync lock held
    across an ``await`` must not let another task of the loop in.
    """
    if asyncio._get_running_loop() is not None and asyncio.current_task() is not None:
        return task_owner()
    return _thread_token()


def task_owner() -> object:
    """The owner token of the running asyncio task.

    Raises:
        RuntimeError: not called from inside an asyncio task.
    """
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("a reentrant AsyncRedisLock must be used inside an asyncio task")
    token = _TASKS.get(task)
    if token is None:
        token = _TASKS.setdefault(task, object())
    return token


@dataclass
class Hold(Generic[H]):
    """One owner's acquisition: the handle of the outermost acquire and the depth."""

    handle: H
    depth: int = 1


class Holds(Generic[H]):
    """The reentrant holds of this process, by store, lock name and owner.

    Only an owner reads or changes its own entries, so no lock is needed.
    A forked child starts empty: it owns none of its parent's locks.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._by_store: weakref.WeakKeyDictionary[Any, dict[tuple[str, object], Hold[H]]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, store: Any, name: str, owner: object) -> Hold[H] | None:
        """The owner's hold of ``name`` on ``store``, if any."""
        per_store = self._by_store.get(store)
        return None if per_store is None else per_store.get((name, owner))

    def add(self, store: Any, name: str, owner: object, handle: H) -> Hold[H]:
        """Record the owner's outermost acquisition (depth 1)."""
        per_store = self._by_store.get(store)
        if per_store is None:
            per_store = self._by_store.setdefault(store, {})
        hold = per_store[(name, owner)] = Hold(handle)
        return hold

    def remove(self, store: Any, name: str, owner: object, handle: H) -> None:
        """Forget the owner's hold of ``handle`` (its last release); idempotent.

        A hold of another handle (a later acquisition) is left alone.
        """
        per_store = self._by_store.get(store)
        if per_store is None:
            return
        hold = per_store.get((name, owner))
        if hold is not None and hold.handle is handle:
            del per_store[(name, owner)]
