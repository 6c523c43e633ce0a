"""No-op tasks for each contender, run by `celery worker` subprocesses in the bench.

Configured from the environment: BENCH_BROKER_URL (broker, and the done
counter in database 3) and BENCH_LOCK_URL (the lock store every contender
uses, a separate redis-server so its commands can be counted).
"""

from __future__ import annotations

import os

import redis

from bench.common import bench_app, broker_url
from celery_redislock import SingletonTask

app = bench_app("bench", prefetch=4)

_done: redis.Redis | None = None


def done() -> None:
    global _done
    if _done is None or _done.connection_pool.pid != os.getpid():  # type: ignore[attr-defined]
        _done = redis.Redis.from_url(f"{broker_url()}/3")
    _done.incr("done")


@app.task(name="bench.plain")
def plain(n: int) -> None:
    done()


@app.task(name="bench.redislock", base=SingletonTask)
def redislock(n: int) -> None:
    done()


@app.task(name="bench.redislock_limit3", base=SingletonTask, lock_limit=3)
def redislock_limit3(n: int) -> None:
    """At most 3 per key (``lock_limit=3``): the slot script instead of the single-key one."""
    done()


try:
    from celery_singleton import Singleton
except ImportError:  # the bench extra is not installed
    Singleton = None

try:
    from celery_once import QueueOnce
except ImportError:
    QueueOnce = None

if Singleton is not None:

    @app.task(name="bench.celery_singleton", base=Singleton)
    def celery_singleton(n: int) -> None:
        done()


if QueueOnce is not None:

    @app.task(name="bench.celery_once", base=QueueOnce)
    def celery_once(n: int) -> None:
        done()
