"""Fencing a SQL row: a paused or partitioned old holder cannot overwrite newer data.

    REDIS_URL=redis://localhost:6379 python -m examples.fencing

The task passes ``self.lock.fence`` with its write; the row remembers the
highest fence that wrote it and refuses anything older. Here two lock
holders are simulated in one process: the first "pauses" past its TTL, the
second takes the lock and writes, then the first wakes up and tries.
"""

from __future__ import annotations

import os
import sqlite3
import time

import redis

from celery_redislock import RedisLock

SCHEMA = "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER, last_fence INTEGER)"

# 0 rows updated means a newer lock holder has already written: stop.
FENCED_UPDATE = """
UPDATE accounts SET balance = :balance, last_fence = :fence
 WHERE id = :id AND last_fence < :fence
"""


def write_balance(db: sqlite3.Connection, account: int, balance: int, fence: int) -> bool:
    with db:
        cursor = db.execute(FENCED_UPDATE, {"id": account, "balance": balance, "fence": fence})
    return cursor.rowcount == 1


def main() -> None:
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://localhost:6379"))
    db = sqlite3.connect(":memory:")
    db.execute(SCHEMA)
    db.execute("INSERT INTO accounts VALUES (7, 100, 0)")

    old = RedisLock(client, "example:account:7", ttl=1, renew=False)  # no renewal: it "pauses"
    assert old.acquire()
    assert old.fence is not None
    old_fence = old.fence
    time.sleep(1.2)  # the GC pause: the TTL runs out

    new = RedisLock(client, "example:account:7", ttl=10)
    assert new.acquire(timeout=5)
    assert new.fence is not None
    print("new holder writes 90:", write_balance(db, 7, 90, new.fence))
    print("old holder (woke up) writes 50:", write_balance(db, 7, 50, old_fence))
    print("balance:", db.execute("SELECT balance, last_fence FROM accounts").fetchone())
    new.release()
    old.release()


if __name__ == "__main__":
    main()
