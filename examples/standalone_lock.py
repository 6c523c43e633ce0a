"""RedisLock outside Celery: a cron script that must not run twice at once.

REDIS_URL=redis://localhost:6379 python -m examples.standalone_lock
"""

from __future__ import annotations

import os
import time

import redis

from celery_redislock import LockContended, RedisLock


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


if __name__ == "__main__":
    main()
