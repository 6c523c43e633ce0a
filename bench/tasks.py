"""No-op tasks for each contender, run by `celery worker` subprocesses in the bench.

Configured from the environment: BENCH_BROKER_URL (broker, and the done
counter in database 3) and BENCH_LOCK_URL (the lock store every contender
uses, a separate redis-server so its commands can be counted).
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

import redis

from bench.common import bench_app, broker_url, lock_url
from celery_redislock import Retry, SingletonTask, Wait

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


_floor = threading.local()


def _two_bare_round_trips(n: int) -> None:
    """``SET NX PX GET`` and ``DEL`` of a per-task key on a bare socket, no client library.

    The floor of what any lock that takes and frees a key in the worker
    costs there: the same two round trips as this package's uncontended
    cycle, with no parsing, no ownership check and no features.
    """
    if getattr(_floor, "pid", None) != os.getpid():
        address = urlsplit(lock_url())
        _floor.sock = socket.create_connection((address.hostname, address.port or 6379))
        _floor.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _floor.pid = os.getpid()
    key = f"floor:{n}".encode()
    head = b"$%d\r\n%s\r\n" % (len(key), key)
    _floor.sock.sendall(
        b"*7\r\n$3\r\nSET\r\n" + head + b"$1\r\n1\r\n$2\r\nNX\r\n$2\r\nPX\r\n"
        b"$5\r\n30000\r\n$3\r\nGET\r\n"
    )
    _floor.sock.recv(64)
    _floor.sock.sendall(b"*2\r\n$3\r\nDEL\r\n" + head)
    _floor.sock.recv(64)


@app.task(name="bench.floor")
def floor(n: int) -> None:
    """A plain task that makes two bare round trips to the lock store: the floor of a lock."""
    _two_bare_round_trips(n)
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


# Scenario 6: contended executions of one key, by policy. Each body records
# when it started and ended (database 3, list "spans:<contender>").
def _span(contender: str, label: str, seconds: float) -> None:
    import time

    start = time.time()
    time.sleep(seconds)
    global _done
    if _done is None or _done.connection_pool.pid != os.getpid():  # type: ignore[attr-defined]
        _done = redis.Redis.from_url(f"{broker_url()}/3")
    _done.rpush(f"spans:{contender}", f"{start}|{time.time()}|{label}")


@app.task(
    name="bench.contended_handoff",
    base=SingletonTask,
    lock_args=("group",),
    lock_on_contention="handoff",
)
def contended_handoff(group: str, label: str, seconds: float) -> None:
    _span("handoff", label, seconds)


@app.task(
    name="bench.contended_wait",
    base=SingletonTask,
    lock_args=("group",),
    lock_on_contention=Wait(timeout=120),
)
def contended_wait(group: str, label: str, seconds: float) -> None:
    _span("wait", label, seconds)


@app.task(
    name="bench.contended_retry",
    base=SingletonTask,
    lock_args=("group",),
    lock_ttl=3,
    lock_on_contention=Retry(jitter=0.2, max_retries=1000),
)
def contended_retry(group: str, label: str, seconds: float) -> None:
    _span("retry", label, seconds)


# Scenario 7: a storm of calls for one key; the body reads a counter the
# caller bumps before each call ("seen:<contender>": start|value seen).
def _seen(contender: str, seconds: float) -> None:
    import time

    global _done
    if _done is None or _done.connection_pool.pid != os.getpid():  # type: ignore[attr-defined]
        _done = redis.Redis.from_url(f"{broker_url()}/3")
    start = time.time()
    value = int(_done.get("counter") or 0)
    time.sleep(seconds)
    _done.rpush(f"seen:{contender}", f"{start}|{value}")


@app.task(name="bench.storm_until_start", base=SingletonTask, lock_enqueue="until_start")
def storm_until_start(group: str, seconds: float) -> None:
    _seen("until_start", seconds)


@app.task(name="bench.storm_until_done", base=SingletonTask, lock_enqueue=True)
def storm_until_done(group: str, seconds: float) -> None:
    _seen("until_done", seconds)


@app.task(name="bench.storm_debounce", base=SingletonTask, lock_debounce=0.5)
def storm_debounce(group: str, seconds: float) -> None:
    _seen("debounce", seconds)
