"""No-op tasks for each contender, run by `celery worker` subprocesses in the bench.

Configured from the environment: BENCH_BROKER_URL (broker, and the done
counter in database 3) and BENCH_LOCK_URL (the lock store every contender
uses, a separate redis-server so its commands can be counted).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery

from celery_redislock import SingletonTask

BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379").rstrip("/")
LOCKS = os.environ.get("BENCH_LOCK_URL", "redis://127.0.0.1:6379").rstrip("/")

app = Celery("bench")
app.conf.update(
    broker_url=f"{BROKER}/0",
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    redislock_url=f"{LOCKS}/0",
    singleton_backend_url=f"{LOCKS}/0",
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": f"{LOCKS}/0", "default_timeout": 3600},
    },
)

_done: redis.Redis | None = None


def done() -> None:
    global _done
    if _done is None or _done.connection_pool.pid != os.getpid():  # type: ignore[attr-defined]
        _done = redis.Redis.from_url(f"{BROKER}/3")
    _done.incr("done")


@app.task(name="bench.plain")
def plain(n: int) -> None:
    done()


@app.task(name="bench.redislock", base=SingletonTask)
def redislock(n: int) -> None:
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


def crash_tasks() -> dict[str, Any]:
    """Long tasks for the crash-recovery scenario (defined lazily with a TTL)."""
    return {}
