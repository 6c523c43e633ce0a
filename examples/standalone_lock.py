"""RedisLock outside Celery: a cron script that must not run twice at once.

Also its reentrant form (nested code paths taking the same lock) and
AsyncRedisLock (the same lock for asyncio code).

REDIS_URL=redis://localhost:6379 python -m examples.standalone_lock
"""

from __future__ import annotations

import asyncio
import os
import time

import redis
import redis.asyncio

from celery_redislock import AsyncRedisLock, LockContended, RedisLock


def rebuild_search_index() -> None:
    time.sleep(2)


def main() -> None:
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://localhost:6379"))
    lock = RedisLock(client, "cron:rebuild-search-index", ttl=10, timeout=0)
    try:
        with lock:  # renewed every ttl/3 while held
            rebuild_search_index()
            print("index rebuilt; lock still ours:", lock.owned)
    except LockContended as busy:
        print(f"another run holds the lock (expires in {busy.ttl_remaining:.1f}s); exiting")

    # Or as a decorator; each call waits up to 30 s for the lock.
    @RedisLock(client, "cron:compact", ttl=10, timeout=30)
    def compact() -> str:
        return "compacted"

    print(compact())

    # Reentrant: the thread holding it may take it again (depth 2, one fence).
    ledger = RedisLock(client, "billing:ledger", ttl=10, reentrant=True)

    def post(entry: str) -> None:
        with ledger:
            print(f"posted {entry} at depth {ledger.depth}, fence {ledger.fence}")

    with ledger:
        post("refund-42")
    print("ledger free again:", not client.exists("billing:ledger"))

    asyncio.run(async_report(os.environ.get("REDIS_URL", "redis://localhost:6379")))


async def async_report(url: str) -> None:
    """AsyncRedisLock: waits woken by the release, renewed by one task per loop."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        async with AsyncRedisLock(client, "web:daily-report", ttl=10, timeout=5) as lock:
            await asyncio.sleep(0.1)
            print("async report built; lock still ours:", lock.owned)
    finally:
        await client.aclose()


if __name__ == "__main__":
    main()
