"""A signal storm against the lock's Redis calls, run as a script (see test_abort.py).

SIGALRM fires at a random moment of each call and its handler raises, so
exceptions land at random points of acquire, release, blocking acquire
(pub/sub) and extend, including between sending a command and reading its
reply. Two phases:

1. ``RedisLock`` cycles, while the renewer thread keeps a set of locks alive;
2. the worker's own path: ``SingletonTask.__call__`` under a pushed
   request, as a pool child runs it.

It prints one JSON line of counters; every one but ``cycles``,
``interrupts``, ``grants``, ``task_runs``, ``task_keys_taken_back_late`` and
``renewals`` must be zero.

Usage: python -m tests.integration.storm REDIS_URL CYCLES [SEED]
"""

from __future__ import annotations

import functools
import json
import logging
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery

from celery_redislock import RedisLock, SingletonTask, lock_lost
from celery_redislock.renewer import renewer
from tests.servers import wait_until


class Interrupt(Exception):
    """What a soft time limit or an abort looks like: an Exception."""


class HardInterrupt(BaseException):
    """What KeyboardInterrupt or SystemExit looks like: a BaseException."""


armed = False
#: Longest delay before the alarm, in seconds (set by calibrate()).
alarm_max = 0.0015


def on_alarm(signum: int, frame: Any) -> None:
    if armed:
        raise Interrupt() if random.random() < 0.5 else HardInterrupt()


def arm() -> None:
    """Arm the alarm: mostly within a connected call, sometimes long enough for a reconnect.

    Every interrupted exchange costs its connection, and the reconnect
    (connect, handshake) takes several calls' time: alarms that are all
    short would interrupt the reconnects for ever.
    """
    global armed
    armed = True
    limit = alarm_max if random.random() < 0.6 else alarm_max * 10
    signal.setitimer(signal.ITIMER_REAL, random.uniform(0.00002, limit))


def disarm() -> None:
    global armed
    armed = False
    signal.setitimer(signal.ITIMER_REAL, 0)


def calibrate(call: Callable[[], Any]) -> None:
    """Let the alarm fire within 1.5 uninterrupted calls, so about half are interrupted.

    A fixed range would interrupt nearly every call on a slow machine and
    almost none on a fast one.
    """
    global alarm_max
    durations = []
    for _ in range(50):
        started = time.perf_counter()
        call()
        durations.append(time.perf_counter() - started)
    durations.sort()
    alarm_max = max(1.5 * durations[len(durations) // 2], 0.0001)


class CountingHandler(logging.Handler):
    """Counts the renewer's complaints: a shifted reply shows up as one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.samples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.samples) < 5:
            self.samples.append(record.getMessage())


def stormy(counts: dict[str, int], call: Callable[[], Any]) -> Any:
    """Run ``call`` with the alarm armed; count interrupts and anything else raised.

    Not a context manager: contextlib's own frames would be interrupted too.
    """
    try:
        try:
            arm()
            return call()
        finally:
            disarm()
    except (Interrupt, HardInterrupt):
        counts["interrupts"] += 1
    except Exception as exc:  # a shifted reply parses as nonsense
        counts["unexpected_errors"] += 1
        if counts["unexpected_errors"] <= 3:
            print(f"unexpected: {type(exc).__name__}: {exc}", file=sys.stderr)
    return None


def lock_storm(
    client: redis.Redis, truth: redis.Redis, cycles: int, counts: dict[str, int]
) -> None:
    """RedisLock cycles; a granted lock must hold our value in Redis."""
    # Keys another owner holds for the whole storm: never ours to take.
    foreign = [f"storm:foreign:{n}" for n in range(8)]
    for key in foreign:
        truth.set(key, "v1|someone-else|0|elsewhere|1|nonce|other|0", px=600_000)
    free = [f"storm:free:{n}" for n in range(64)]

    def one_cycle() -> None:
        lock = RedisLock(client, random.choice(free), ttl=1.0)
        if lock.acquire(blocking=False):
            lock.release()

    calibrate(one_cycle)
    for _ in range(cycles):
        counts["cycles"] += 1
        key = random.choice(foreign) if random.random() < 0.2 else random.choice(free)
        lock = RedisLock(client, key, ttl=1.0, renew=random.random() < 0.5)
        if random.random() < 0.1:
            granted = stormy(counts, functools.partial(lock.acquire, blocking=True, timeout=0.002))
        else:
            granted = stormy(counts, functools.partial(lock.acquire, blocking=False))
        if granted:
            counts["grants"] += 1
            if key in foreign:
                counts["foreign_grants"] += 1
            # Granted means the key holds our value now: nobody else writes
            # our keys, and we have not released it yet.
            assert lock.handle is not None
            if truth.get(key) != lock.handle.value.encode():
                counts["wrong_grants"] += 1
            if random.random() < 0.2:
                stormy(counts, lock.extend)
            stormy(counts, lock.release)


def task_storm(url: str, truth: redis.Redis, cycles: int, counts: dict[str, int]) -> None:
    """The worker's own path: ``SingletonTask.__call__`` under a request, as in a pool child.

    After every execution, however it was interrupted, its key must be free
    (a foreign-held key must still hold the foreign value), and a body that
    ran must have found its own value in Redis. An acquire cut off between
    send and reply can still land after its own take-back (the server reads
    the dead connection after the take-back's): its value is then taken
    back in the background (takeback.py), so a key is "left" only if it is
    still there once the take-backs in flight are done. The TTL (5 s) is
    longer than that wait, so expiry cannot pass for a take-back.
    """
    app = Celery("storm", set_as_current=False)
    app.conf.update(redislock_url=url, redislock_ttl=5.0, broker_url="memory://")

    @app.task(base=SingletonTask, bind=True, shared=False, lock_on_contention="skip")
    def job(self: Any, name: str) -> bool:
        # The checking client is redis-py's: an interrupt inside it would
        # leave its pooled connection with an unread reply. Check disarmed,
        # then arm a new alarm for the rest of the execution (the release).
        was_armed = armed
        disarm()
        ours = truth.get(self.lock.key) == self.lock.value.encode()
        if was_armed:
            arm()
        return ours

    def execute(n: int, name: str) -> Any:
        job.push_request(id=f"storm-{n}", retries=0, hostname="storm@h", called_directly=False)
        try:
            return stormy(counts, lambda: job(name))
        finally:
            job.pop_request()

    names = [f"foreign-{n}" for n in range(4)]  # calls whose key another owner holds
    foreign_values = {}
    for name in names:
        key = job.lock_key_for((name,), {})
        foreign_values[key] = b"v1|someone-else|0|elsewhere|1|nonce|other|0"
        truth.set(key, foreign_values[key], px=600_000)
    counts.update(
        task_runs=0,
        task_wrong_grants=0,
        task_keys_left=0,
        task_keys_taken_back_late=0,
        task_foreign_touched=0,
    )

    def one_execution() -> None:
        job.push_request(id="calibration", retries=0, hostname="storm@h", called_directly=False)
        try:
            job(f"free-{random.randrange(64)}")
        finally:
            job.pop_request()

    calibrate(one_execution)
    for n in range(cycles):
        name = random.choice(names) if random.random() < 0.2 else f"free-{n % 64}"
        outcome = execute(n, name)
        if outcome is True:
            counts["task_runs"] += 1
        elif outcome is False:
            counts["task_wrong_grants"] += 1
        if name.startswith("free-") and truth.exists(job.lock_key_for((name,), {})):
            key = job.lock_key_for((name,), {})
            try:
                wait_until(lambda k=key: not truth.exists(k), timeout=3.0, interval=0.01)
                counts["task_keys_taken_back_late"] += 1
            except AssertionError:
                counts["task_keys_left"] += 1
    for key, value in foreign_values.items():
        if truth.get(key) != value:
            counts["task_foreign_touched"] += 1


def main() -> None:
    url, cycles = sys.argv[1], int(sys.argv[2])
    random.seed(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    client = redis.Redis.from_url(url, socket_timeout=5)
    truth = redis.Redis.from_url(url)  # only ever used with the timer disarmed
    complaints = CountingHandler()
    # Interrupted releases are expected to complain; the renewer never should.
    logging.getLogger("celery_redislock").setLevel(logging.CRITICAL)
    logging.getLogger("celery_redislock.renewal").setLevel(logging.WARNING)
    logging.getLogger("celery_redislock.renewal").addHandler(complaints)
    lost: list[str] = []
    lock_lost.connect(
        lambda sender=None, **kw: lost.append(f"{kw['key']}:{kw['reason']}"), weak=False
    )

    # Locks kept alive by the renewer for the whole storm (renewed every 0.33 s;
    # a 0.3 s TTL was lost to scheduling alone on a loaded 2-core machine).
    kept = [RedisLock(client, f"storm:kept:{n}", ttl=1.0) for n in range(8)]
    for lock in kept:
        assert lock.acquire(blocking=False)
    counts = {
        "cycles": 0,
        "interrupts": 0,
        "grants": 0,
        "wrong_grants": 0,
        "foreign_grants": 0,
        "unexpected_errors": 0,
    }
    signal.signal(signal.SIGALRM, on_alarm)
    lock_storm(client, truth, cycles, counts)
    task_storm(url, truth, cycles, counts)
    # The renewer must still hold every kept lock, and never have complained.
    # Two more renewal round trips, to let a late mix-up show.
    trips = renewer().round_trips
    wait_until(lambda: renewer().round_trips >= trips + 2, timeout=10)
    counts["kept_lost"] = sum(1 for lock in kept if lock.lost or not lock.owned)
    counts["kept_missing"] = sum(
        1
        for lock in kept
        if lock.handle is None or truth.get(lock.name) != lock.handle.value.encode()
    )
    counts["lost_signals"] = len(lost)
    counts["renewer_complaints"] = complaints.count
    counts["renewals"] = renewer().round_trips
    for lock in kept:
        lock.release()
    print(json.dumps(counts))
    if complaints.samples:
        print("renewer said: " + " | ".join(complaints.samples), file=sys.stderr)
    if lost:
        print(f"lost: {lost[:10]}", file=sys.stderr)


if __name__ == "__main__":
    main()
