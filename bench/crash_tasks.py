"""30-second tasks for the crash-recovery scenario, per contender and TTL variant."""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from bench.common import bench_app, broker_url
from celery_redislock import SingletonTask

app = bench_app("bench_crash", prefetch=1)

#: How each contender's lock lifetime reads in the report.
TTL_NOTE: dict[tuple[str, str], str] = {
    ("redislock", "default"): "default TTL 30 s, renewed",
    ("redislock", "ttl60"): "TTL 60 s, renewed",
    ("celery_singleton", "default"): "default: no expiry",
    ("celery_singleton", "ttl60"): "lock_expiry 60 s",
    ("celery_once", "default"): "default timeout 3600 s",
    ("celery_once", "ttl60"): "timeout 60 s",
}


def _body() -> None:
    record = redis.Redis.from_url(f"{broker_url()}/3")
    record.set("at", time.time())  # before "pid": a reader that sees "pid" finds "at"
    record.set("pid", os.getpid())
    time.sleep(30)


def _define(name: str, **options: Any) -> None:
    @app.task(name=name, **options)
    def crash(key: str) -> None:
        _body()


_define("crash.redislock.default", base=SingletonTask, lock_args=("key",))
_define("crash.redislock.ttl60", base=SingletonTask, lock_args=("key",), lock_ttl=60)

try:
    from celery_singleton import Singleton
except ImportError:
    pass
else:
    _define("crash.celery_singleton.default", base=Singleton)
    _define("crash.celery_singleton.ttl60", base=Singleton, lock_expiry=60)

try:
    from celery_once import QueueOnce
except ImportError:
    pass
else:
    _define("crash.celery_once.default", base=QueueOnce)
    _define("crash.celery_once.ttl60", base=QueueOnce, once={"timeout": 60})
