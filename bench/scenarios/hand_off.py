"""Scenario 4: hand-off latency, from a release to the waiter holding the lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bench.report import Report, percentile
from celery_redislock import RedisLock
from tests.servers import RedisServer


def hand_off(report: Report, rounds: int, handoffs: int) -> None:
    server = RedisServer()
    client = server.client()
    scenario = "4. hand-off latency (holder's release → waiter holds the lock)"

    def measure(make: Callable[[], Any], acquire: Callable[[Any], bool]) -> list[float]:
        samples = []
        for n in range(handoffs):
            holder = make()
            assert acquire(holder)
            got: list[float] = []
            waiter = make()

            def wait(w: Any = waiter, into: list[float] = got) -> None:
                if acquire(w):
                    into.append(time.perf_counter())

            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(0.02 + (n % 3) * 0.01)  # the waiter is blocked by now
            released = time.perf_counter()
            holder.release()
            thread.join(10)
            waiter.release()
            samples.append(got[0] - released)
        return samples

    contenders = {
        "celery-redislock (pub/sub wake-up, as the wait policy)": (
            lambda: RedisLock(client, "handoff", ttl=30, timeout=10),
            lambda lock: lock.acquire(),
        ),
        "redis-py Lock (blocking, default 0.1 s polling)": (
            lambda: client.lock("handoff-rp", timeout=30, blocking_timeout=10, thread_local=False),
            lambda lock: lock.acquire(),
        ),
    }
    try:
        for round_no in range(rounds):
            line = []
            for name, (make, acquire) in contenders.items():
                samples = measure(make, acquire)
                p50, p99 = percentile(samples, 0.5) * 1000, percentile(samples, 0.99) * 1000
                report.add(scenario, name, "p50", "ms", p50)
                report.add(scenario, name, "p99", "ms", p99)
                line.append(f"{name.split(' (')[0]} p50 {p50:.2f} ms p99 {p99:.2f} ms")
            print(f"  round {round_no + 1}/{rounds}: " + "; ".join(line), flush=True)
    finally:
        server.close()
