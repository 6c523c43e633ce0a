"""Scenario 2: lock cycles (acquire + release) per second on one connection."""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.harness import count_round_trips, peers_available
from bench.report import Report
from celery_redislock import RedisLock
from tests.servers import RedisServer


def lock_cycle(report: Report, rounds: int, seconds: float) -> None:
    server = RedisServer()
    client = server.client()
    available = peers_available()

    def ours(i: int) -> None:
        lock = RedisLock(client, f"cycle:{i}", ttl=30)
        lock.acquire(blocking=False)
        lock.release()

    def redis_py(i: int) -> None:
        lock = client.lock(f"cycle:{i}", timeout=30)
        lock.acquire(blocking=False)
        lock.release()

    cycles: dict[str, Callable[[int], None]] = {
        "redis-py Lock": redis_py,
        "celery-redislock RedisLock": ours,
    }
    if available["redis_lock"]:
        import redis_lock

        def python_redis_lock(i: int) -> None:
            lock = redis_lock.Lock(client, f"cycle:{i}", expire=30)
            lock.acquire(blocking=False)
            lock.release()

        cycles["python-redis-lock"] = python_redis_lock
    if available["pottery"]:
        from pottery import Redlock

        def pottery_redlock(i: int) -> None:
            lock = Redlock(key=f"cycle:{i}", masters={client}, auto_release_time=30)
            lock.acquire(blocking=False)
            lock.release()

        cycles["pottery Redlock (1 master)"] = pottery_redlock
    scenario = "2. lock cycle (acquire+release, one process)"
    try:
        for name, cycle in cycles.items():
            trips = count_round_trips(server, lambda c=cycle: [c(i) for i in range(50)])
            report.add(scenario, name, "round trips per cycle", "commands", trips / 50)
        for round_no in range(rounds):
            rates = {}
            for name, cycle in cycles.items():
                for i in range(200):  # warm up connections and script caches
                    cycle(i)
                count = 0
                deadline = time.perf_counter() + seconds
                started = time.perf_counter()
                while time.perf_counter() < deadline:
                    cycle(count % 1000)
                    count += 1
                rates[name] = count / (time.perf_counter() - started)
            for name in cycles:
                report.add(
                    scenario,
                    name,
                    "cycles/s",
                    "cycles/s",
                    rates[name],
                    rates[name] / rates["redis-py Lock"],
                )
            print(
                f"  round {round_no + 1}/{rounds}: "
                + ", ".join(f"{k} {v:.0f}/s" for k, v in rates.items()),
                flush=True,
            )
    finally:
        server.close()
