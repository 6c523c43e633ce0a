"""Scenario 3: renewal of many held locks: round trips and CPU per tick."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import redis

from bench.harness import peers_available
from bench.report import Report
from celery_redislock import RedisLock
from celery_redislock.renewer import renewer
from tests.servers import RedisServer


def renewal_at_scale(report: Report, rounds: int, sizes: list[int], hold: float) -> None:
    server = RedisServer()
    client = server.client()
    available = peers_available()
    ttl = 3.0
    try:
        for size in sizes:
            scenario = f"3. renewal at scale ({size} locks, TTL {ttl:g}s, held {hold:g}s)"
            variants = [
                ("celery-redislock (one renewer thread)", False),
                # Reentrant locks ride the same batched tick as plain ones.
                ("celery-redislock, half reentrant at depth 2", True),
            ]
            for contender, mixed in variants:
                for _ in range(rounds):
                    _renewal_round(
                        report, scenario, contender, mixed, client, server, size, ttl, hold
                    )
            if size <= 1000 and available["redis_lock"]:
                _python_redis_lock_renewal(report, client, server, rounds, size, ttl, hold)
    finally:
        server.close()


def _renewal_round(
    report: Report,
    scenario: str,
    contender: str,
    mixed: bool,
    client: redis.Redis,
    server: RedisServer,
    size: int,
    ttl: float,
    hold: float,
) -> None:
    server.client().flushall()
    locks = [
        RedisLock(client, f"renew:{i}", ttl=ttl, reentrant=mixed and i % 2 == 1)
        for i in range(size)
    ]
    for lock in locks:
        lock.acquire(blocking=False)
        if lock.reentrant:
            lock.acquire(blocking=False)
    trips_before, cpu_before = renewer().round_trips, time.process_time()
    handles = [lock._current() for lock in locks]  # (a reentrant lock's: this thread's)
    time.sleep(hold)
    ticks = max(h.renewals for h in handles if h is not None)
    trips = renewer().round_trips - trips_before
    cpu = time.process_time() - cpu_before
    alive = sum(client.exists(lock.name) for lock in locks)
    lost = sum(lock.lost for lock in locks)
    for lock in locks:
        for _ in range(lock.depth):
            lock.release()
    report.add(
        scenario,
        contender,
        "round trips per tick",
        "round trips",
        trips / max(ticks, 1),
    )
    report.add(
        scenario,
        contender,
        "locks per round trip",
        "locks",
        size * ticks / max(trips, 1),
    )
    report.add(
        scenario,
        contender,
        "process CPU per tick",
        "ms",
        1000 * cpu / max(ticks, 1),
    )
    report.add(
        scenario,
        contender,
        "locks expired or lost",
        "locks",
        (size - alive) + lost,
    )


def _python_redis_lock_renewal(
    report: Report,
    client: redis.Redis,
    server: RedisServer,
    rounds: int,
    size: int,
    ttl: float,
    hold: float,
) -> None:
    import redis_lock

    scenario = f"3. renewal at scale ({size} locks, TTL {ttl:g}s, held {hold:g}s)"
    for round_no in range(rounds):
        server.client().flushall()
        threads_before = threading.active_count()
        locks = [
            redis_lock.Lock(client, f"prl:{round_no}:{i}", expire=int(ttl), auto_renewal=True)
            for i in range(size)
        ]
        for lock in locks:
            lock.acquire(blocking=False)
        threads = threading.active_count() - threads_before
        died: list[str] = []
        previous_hook = threading.excepthook

        def record_death(args: Any, into: list[str] = died) -> None:
            into.append(type(args.exc_value).__name__)

        threading.excepthook = record_death
        stats_before = server.client().info("stats")["total_commands_processed"]
        cpu_before = time.process_time()
        time.sleep(hold)
        commands = server.client().info("stats")["total_commands_processed"] - stats_before
        cpu = time.process_time() - cpu_before
        alive = sum(client.exists(f"lock:prl:{round_no}:{i}") for i in range(size))
        for lock in locks:
            with contextlib.suppress(redis_lock.NotAcquired):  # it expired: counted above
                lock.release()
        threading.excepthook = previous_hook
        ticks = hold / (ttl * 2 / 3)
        name = "python-redis-lock (a thread per lock)"
        report.add(scenario, name, "renewal threads", "threads", threads)
        report.add(scenario, name, "round trips per tick", "round trips", commands / max(ticks, 1))
        report.add(scenario, name, "process CPU per tick", "ms", 1000 * cpu / max(ticks, 1))
        report.add(scenario, name, "locks expired or lost", "locks", size - alive)
        report.add(
            scenario,
            name,
            "renewal threads that died",
            "threads",
            len(died),
            note=", ".join(sorted(set(died))),
        )
