"""Scenario 2: lock cycles (acquire + release) per second on one connection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio

from bench.harness import count_round_trips, peers_available
from bench.report import Report
from celery_redislock import AsyncRedisLock, RedisLock
from celery_redislock.aiostore import AsyncLockStore
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

    def ours_reentrant(i: int) -> None:
        lock = RedisLock(client, f"cycle:{i}", ttl=30, reentrant=True)
        lock.acquire(blocking=False)
        lock.release()

    def ours_reentrant_nested(i: int) -> None:
        # Depth 2: the nested acquire is one round trip (it confirms and
        # extends); the nested release is local.
        lock = RedisLock(client, f"cycle:{i}", ttl=30, reentrant=True)
        lock.acquire(blocking=False)
        lock.acquire(blocking=False)
        lock.release()
        lock.release()

    # The asyncio locks run on one event loop driven from this thread; the
    # redis-py asyncio Lock row pays the same run_until_complete overhead.
    loop = asyncio.new_event_loop()
    async_client = redis.asyncio.Redis(port=server.port)

    async def async_ours(i: int) -> None:
        lock = AsyncRedisLock(async_client, f"cycle:{i}", ttl=30)
        await lock.acquire(blocking=False)
        await lock.release()

    async def async_redis_py(i: int) -> None:
        lock = async_client.lock(f"cycle:{i}", timeout=30)
        await lock.acquire(blocking=False)
        await lock.release()

    cycles: dict[str, Callable[[int], None]] = {
        "redis-py Lock": redis_py,
        "celery-redislock RedisLock": ours,
        "celery-redislock RedisLock(reentrant=True)": ours_reentrant,
        "celery-redislock RedisLock(reentrant=True), depth 2": ours_reentrant_nested,
        "redis-py asyncio Lock": lambda i: loop.run_until_complete(async_redis_py(i)),
        "celery-redislock AsyncRedisLock": lambda i: loop.run_until_complete(async_ours(i)),
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
        loop.run_until_complete(AsyncLockStore.for_client(async_client).aclose())
        loop.run_until_complete(async_client.aclose())
        loop.close()
        server.close()
