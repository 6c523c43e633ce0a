"""Helpers shared by the worker tests."""

from __future__ import annotations

from typing import Any

import redis

from celery_redislock.task import SingletonTaskMixin
from celery_redislock.tokens import WAITING, LockOwner, LockValue


def hold_lock(
    client: redis.Redis,
    task: SingletonTaskMixin,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    holder_task_id: str = "holder-task-id",
    ttl: float = 30.0,
) -> tuple[str, str]:
    """Make ``task``'s lock for this call look held by another task; return (key, value)."""
    key = task.lock_key_for(args, kwargs or {})
    value = LockValue.new(LockOwner(holder_task_id, 0, "celery@elsewhere", 1), task.name).encode()
    assert client.set(key, value, nx=True, px=int(ttl * 1000))
    return key, value


def decoded(value: bytes | str | None) -> LockValue | None:
    return None if value is None else LockValue.decode(value)


def held_locks(client: redis.Redis) -> list[bytes]:
    """Lock keys present (fence counters, which may outlive their locks, left out)."""
    return [key for key in client.scan_iter(count=1000) if not key.endswith(b":fence")]


def held(client: redis.Redis, key: str) -> bytes | None:
    """The value ``key`` holds, as its holder stored it: a waiter's mark left out.

    Whoever parks or waits behind a holder appends ``tokens.WAITING`` to its
    value (issue 24), so that its release hands over or wakes them.
    """
    value = client.get(key)
    if value is not None and value.endswith(WAITING.encode()):
        return value[: -len(WAITING)]
    return value
