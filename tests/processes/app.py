"""The app that `celery worker` subprocesses run in the crash and shutdown tests.

Configured from the environment: REDISLOCK_TEST_URL (base redis:// URL of
the test's own server) and REDISLOCK_TEST_TTL (lock TTL in seconds); the
broker as ``tests/brokers.py`` says (REDISLOCK_TEST_BROKER, REDISLOCK_TEST_VHOST).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import task_revoked

from celery_redislock import HandOff, Retry, SingletonTask, Wait, lock_contended, lock_lost
from celery_redislock.fencing import FencedStore
from tests.brokers import subprocess_broker_conf

BASE_URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:1")
TTL = float(os.environ.get("REDISLOCK_TEST_TTL", "30"))

app = Celery("redislock_processes")
app.conf.update(
    **subprocess_broker_conf(f"{BASE_URL}/0"),
    result_backend=f"{BASE_URL}/1",
    redislock_url=f"{BASE_URL}/2",
    redislock_ttl=TTL,
    task_default_queue="tests",
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    result_expires=600,
)
app.conf.update(json.loads(os.environ.get("REDISLOCK_TEST_CONF", "{}")))

BEAT_INTERVAL = os.environ.get("REDISLOCK_TEST_BEAT_INTERVAL")
if BEAT_INTERVAL:
    options: dict[str, Any] = {}
    if os.environ.get("REDISLOCK_TEST_BEAT_EXPIRES"):
        options["expires"] = float(BEAT_INTERVAL)
    app.conf.beat_schedule = {
        "overlapping": {
            "task": "tests.processes.app.periodic",
            "schedule": float(BEAT_INTERVAL),
            "options": options,
        }
    }

_record: redis.Redis | None = None


def record() -> redis.Redis:
    """The database tasks record into (re-created per process)."""
    global _record
    if _record is None or _record.connection_pool.pid != os.getpid():  # type: ignore[attr-defined]
        _record = redis.Redis.from_url(f"{BASE_URL}/3", decode_responses=True)
    return _record


@app.task(base=SingletonTask, bind=True, lock_args=("name",))
def hold(self: Any, name: str, seconds: float) -> str:
    """Record that it started (with its pid, lock key and when), then sleep."""
    record().hset(
        f"started:{self.request.id}",
        mapping={"pid": os.getpid(), "key": self.lock.key, "at": time.time()},
    )
    record().rpush(f"runs:{name}", self.request.id)
    record().rpush(f"events:{name}", f"start:{self.request.id}")
    time.sleep(seconds)
    record().rpush(f"events:{name}", f"end:{self.request.id}")
    return self.request.id


@app.task(base=SingletonTask, bind=True, lock_args=("name",), lock_limit=3)
def hold_limited(self: Any, name: str, seconds: float) -> str:
    """``hold`` with three slots per key (``lock_limit=3``); records its slot key too."""
    record().hset(f"started:{self.request.id}", mapping={"pid": os.getpid(), "key": self.lock.key})
    time.sleep(seconds)
    return self.request.id


@app.task(base=SingletonTask, bind=True, lock_args=("name",), time_limit=1.5)
def hard_limited(self: Any, name: str) -> None:
    record().hset(f"started:{self.request.id}", mapping={"pid": os.getpid(), "key": self.lock.key})
    time.sleep(60)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has ended: its code runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("name",),
    time_limit=1.5,
    lock_on_contention=Wait(timeout=60),
)
def limited_with_cleanup(self: Any, name: str, role: str) -> str:
    """The first run outlives its hard time limit; its ``finally`` takes 50 ms."""
    events = f"events:{name}"
    record().rpush(events, f"start:{role}")
    if role != "first":
        first_pid = int(record().get(f"first-pid:{name}") or 0)
        record().set(f"first-alive-at-duplicate-start:{name}", int(_alive(first_pid)))
        return role
    record().set(f"first-pid:{name}", os.getpid())
    record().hset(f"started:{self.request.id}", mapping={"pid": os.getpid(), "key": self.lock.key})
    try:
        time.sleep(60)
    finally:
        time.sleep(0.05)  # within billiard's 0.1 s SIGTERM grace
        record().rpush(events, f"end:{role}")
    return role


@app.task(base=SingletonTask, bind=True, lock_args=("key",), lock_on_contention=Wait(timeout=120))
def exclusive(self: Any, key: str, n: int) -> int:
    """Count concurrent bodies per key with a Redis gauge and log intervals."""
    store = record()
    concurrent = store.incr(f"active:{key}")
    store.rpush(f"peak:{key}", concurrent)
    started = time.monotonic_ns()
    time.sleep(0.005)
    ended = time.monotonic_ns()
    store.decr(f"active:{key}")
    store.rpush(f"intervals:{key}", f"{started}:{ended}:{os.getpid()}")
    return n


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("name",),
    lock_enqueue=True,
    retry_on_worker_lost=True,
    default_retry_delay=2,
)
def fragile(self: Any, name: str) -> int:
    """Enqueue-locked; its first attempt is killed, retry_on_worker_lost re-sends it."""
    record().hset(
        f"started:{self.request.id}:{self.request.retries}",
        mapping={
            "pid": os.getpid(),
            "key": self.lock.key,
        },
    )
    if self.request.retries == 0:
        time.sleep(60)
    return int(self.request.retries)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("name",),
    lock_enqueue=True,
    retry_on_worker_lost=True,
    max_retries=0,
)
def fragile_out_of_retries(self: Any, name: str) -> int:
    """Like ``fragile``, but Celery will not re-send it: its retries are spent."""
    record().hset(
        f"started:{self.request.id}:{self.request.retries}",
        mapping={"pid": os.getpid(), "key": self.lock.key},
    )
    time.sleep(60)
    return 0


def _hold_then_clean_up(task: Any, name: str, cleanup: float) -> str:
    record().hset(f"started:{task.request.id}", mapping={"pid": os.getpid(), "key": task.lock.key})
    try:
        time.sleep(60)
    finally:
        time.sleep(cleanup)
        record().rpush(f"events:{name}", "cleanup-done")
    return name


@app.task(base=SingletonTask, bind=True, lock_args=("name",))
def slow_cleanup(self: Any, name: str) -> str:
    """Its own ``finally`` takes 1.5 s (a flush, an upload, a rollback)."""
    return _hold_then_clean_up(self, name, 1.5)


@app.task(base=SingletonTask, bind=True, lock_args=("name",))
def stuck_cleanup(self: Any, name: str) -> str:
    """Its own ``finally`` takes 30 s: only a SIGKILL ends it sooner."""
    return _hold_then_clean_up(self, name, 30)


@app.task(base=SingletonTask, bind=True, lock_args=("name",))
def quick_cleanup(self: Any, name: str) -> str:
    """Its own ``finally`` takes 0.3 s, yielding (under gevent, a patched sleep)."""
    return _hold_then_clean_up(self, name, 0.3)


@app.task(base=SingletonTask, bind=True, lock_args=("name",), lock_ttl=0.6)
def green_hold(self: Any, name: str, seconds: float) -> int:
    """Under the gevent pool: hold the lock past TTL/3, so the native renewer renews it."""
    held = self.lock
    time.sleep(seconds)  # patched by gevent: the greenlet yields
    if self.lock is not held or held is None or held.key != self.lock_key_for((name, seconds), {}):
        raise RuntimeError("self.lock is not this greenlet's own lock after a switch")
    return int(held.renewals)


@app.task(base=SingletonTask, lock_args=())
def periodic() -> str:
    """A beat job that runs 3 s whatever its interval."""
    store = record()
    store.rpush("periodic:peak", store.incr("periodic:active"))
    started = time.monotonic_ns()
    time.sleep(3)
    store.decr("periodic:active")
    store.rpush("periodic:intervals", f"{started}:{time.monotonic_ns()}")
    return "ran"


def count_revoked(
    sender: Any = None, request: Any = None, expired: bool = False, **kwargs: Any
) -> None:
    if expired:
        record().incr("expired")
    if request is not None:
        record().incr(f"revoked:{request.id}")


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("name",),
    acks_late=True,
    lock_on_contention=Retry(jitter=0.2, max_retries=200),
)
def fenced_write(self: Any, name: str, seconds: float, tag: str) -> bool:
    """Hold the lock ``seconds``, then write ``tag`` to a fenced resource."""
    store = record()
    fence = self.lock.fence
    store.hset(
        f"started:{self.request.id}",
        mapping={
            "pid": os.getpid(),
            "key": self.lock.key,
            "fence": fence,
            "at": time.time(),
        },
    )
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    accepted = FencedStore(store).write(f"resource:{name}", tag, fence)
    store.rpush(f"writes:{name}", f"{tag}:{fence}:{int(accepted)}:{int(self.lock.lost)}")
    return accepted


# KEYS[1] - last accepted fence, KEYS[2] - history of accepted fences,
# KEYS[3] - count of refused writes; ARGV[1] - the writer's fence
# returns 1 if accepted (fence > last), else 0
_FENCED_APPEND = """
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) <= last then
    redis.call('INCR', KEYS[3])
    return 0
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("key",),
    lock_ttl=2,
    acks_late=True,
    reject_on_worker_lost=True,
    lock_on_contention=Wait(timeout=120),
)
def soak(self: Any, key: str, n: int) -> int:
    """One fenced write per execution; the resource refuses stale fences."""
    store = record()
    time.sleep(0.001)
    store.eval(
        _FENCED_APPEND,
        3,
        f"soak:last:{key}",
        f"soak:history:{key}",
        f"soak:refused:{key}",
        self.lock.fence,
    )
    store.incr("soak:done")
    return n


def count_loss(sender: Any = None, **kwargs: Any) -> None:
    record().incr(f"lost:{kwargs['reason']}")


def count_contention(sender: Any = None, **kwargs: Any) -> None:
    record().incr(f"contended:{kwargs['policy']}")


# Counted only in the worker processes the tests start: the test process
# imports this module too, and must not send its own events here.
if "REDISLOCK_TEST_URL" in os.environ:
    task_revoked.connect(count_revoked, weak=False)
    lock_lost.connect(count_loss, weak=False)
    lock_contended.connect(count_contention, weak=False)


@app.task(
    base=SingletonTask,
    bind=True,
    lock_args=("name",),
    lock_on_contention=HandOff(jitter=0.2),
)
def parked(self: Any, name: str, seconds: float) -> str:
    """Like ``hold``, but a contended run parks until the holder's release hands it over."""
    record().hset(f"started:{self.request.id}", mapping={"pid": os.getpid(), "key": self.lock.key})
    record().rpush(f"events:{name}", f"start:{self.request.id}:{time.time()}")
    time.sleep(seconds)
    record().rpush(f"events:{name}", f"end:{self.request.id}:{time.time()}")
    return self.request.id


@app.task(base=SingletonTask, bind=True, lock_args=("name",), lock_enqueue="until_start")
def coalesced(self: Any, name: str, seconds: float) -> str:
    """Coalescing (``until_start``): records its start and end, then sleeps."""
    record().hset(f"started:{self.request.id}", mapping={"pid": os.getpid(), "key": self.lock.key})
    record().rpush(f"events:{name}", f"start:{self.request.id}:{time.time()}")
    time.sleep(seconds)
    record().rpush(f"events:{name}", f"end:{self.request.id}:{time.time()}")
    return self.request.id


@app.task(base=SingletonTask, bind=True, lock_args=("name",), lock_debounce=6.0)
def debounced(self: Any, name: str) -> str:
    """Trailing debounce of six seconds (time to kill a worker before it is due)."""
    record().rpush(f"events:{name}", f"start:{self.request.id}:{time.time()}")
    return self.request.id


@app.task(base=SingletonTask, bind=True, lock_args=("name",))
def survives_soft_limit(self: Any, name: str) -> str:
    """Catches SoftTimeLimitExceeded (SIGUSR1) and goes on holding its lock for 2 s."""
    record().hset(f"started:{self.request.id}", mapping={"pid": os.getpid(), "key": self.lock.key})
    try:
        time.sleep(60)
    except SoftTimeLimitExceeded:
        record().rpush(f"events:{name}", "soft")
        time.sleep(2)
    return name


@app.task(base=SingletonTask, bind=True, lock_args=("name",))
def survives_kill(self: Any, name: str, then: float = 0.0) -> str:
    """Under gevent: swallows the greenlet's kill (GreenletExit), runs on ``then`` s, ends."""
    record().hset(f"started:{self.request.id}", mapping={"pid": os.getpid(), "key": self.lock.key})
    try:
        time.sleep(60)
    except BaseException:
        record().rpush(f"events:{name}", "killed")
    time.sleep(then)
    return name
