"""Scenario 1: per-task overhead, end to end, against a plain task and the peers."""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from bench.harness import (
    command_origins,
    reset_peer_globals,
    round_trips,
    server_cost,
    tree_counters,
    worker,
)
from bench.report import Report
from tests.servers import RedisServer, wait_until

#: Turns each contender takes per round.
_CHUNKS = 5


def per_task_overhead(report: Report, rounds: int, n: int, contenders: list[str]) -> None:
    broker, locks = RedisServer(), RedisServer()
    os.environ["BENCH_BROKER_URL"], os.environ["BENCH_LOCK_URL"] = broker.url, locks.url
    import importlib

    from bench import tasks

    tasks = importlib.reload(tasks)
    reset_peer_globals()
    tasks.app.conf.update(broker_url=f"{broker.url}/0", redislock_url=f"{locks.url}/0")
    counter = broker.client(3)
    try:
        for pool, concurrency in (("threads", 4), ("prefork", 2)):
            scenario = f"1. per-task overhead ({pool} -c {concurrency}, {n} no-op tasks)"
            origins: dict[str, dict[str, tuple[int, int]]] = {}
            for round_no in range(rounds):
                with worker(broker, locks, pool, concurrency) as process:
                    order = (
                        contenders[round_no % len(contenders) :]
                        + contenders[: round_no % len(contenders)]
                    )
                    # Contenders take turns in chunks: the machine's speed drifts
                    # within a round, and one contender's whole drain against
                    # another's put the two-bare-round-trips floor above plain.
                    chunk = max(n // _CHUNKS, 1)
                    seconds = dict.fromkeys(contenders, 0.0)
                    used = dict.fromkeys(contenders, 0.0)
                    for chunk_no in range(_CHUNKS):
                        for contender in order:
                            before = worker_cpu(process.pid)
                            batch = round_no * _CHUNKS + chunk_no
                            rate = _drain(tasks, contender, chunk, counter, locks, batch)
                            used[contender] += worker_cpu(process.pid) - before
                            seconds[contender] += chunk / rate
                    done = chunk * _CHUNKS
                    rates = {c: done / seconds[c] for c in contenders}
                    cpu = {c: used[c] / done * 1e6 for c in contenders}
                    for contender in contenders:
                        report.add(
                            scenario,
                            contender,
                            "worker CPU per task (all its processes)",
                            "µs",
                            cpu[contender],
                        )
                        report.add(
                            scenario,
                            contender,
                            "worker CPU the lock adds per task (vs plain)",
                            "µs",
                            cpu[contender] - cpu["plain"],
                        )
                    for contender in contenders:
                        report.add(
                            scenario,
                            contender,
                            "throughput",
                            "tasks/s",
                            rates[contender],
                            rates[contender] / rates["plain"],
                        )
                    if round_no == 0:
                        for contender in contenders:
                            origins[contender] = command_origins(
                                locks, lambda c=contender: _drain(tasks, c, 200, counter, locks, 99)
                            )
                            report.add(
                                scenario,
                                contender,
                                "lock-store round trips per task",
                                "commands",
                                round_trips(origins[contender]) / 200,
                            )
                    for contender in contenders:
                        cost = server_cost(
                            locks,
                            lambda c=contender: _drain(tasks, c, n // 4, counter, locks, 98),
                            origins[contender],
                        )
                        for metric, unit, value in (
                            ("lock-store server execution per task", "µs", cost.execution_us),
                            ("lock-store server main-thread CPU per task", "µs", cost.cpu_us),
                            (
                                "lock-store server commands per task (scripts' included)",
                                "commands",
                                cost.commands,
                            ),
                        ):
                            report.add(scenario, contender, metric, unit, value / (n // 4))
                print(
                    f"  {pool} round {round_no + 1}/{rounds}: "
                    + ", ".join(f"{c} {rates[c]:.0f}/s {cpu[c]:.0f} µs" for c in contenders),
                    flush=True,
                )
    finally:
        broker.close()
        locks.close()


def _drain(
    tasks: Any, contender: str, n: int, counter: redis.Redis, locks: RedisServer, round_no: int
) -> float:
    task = tasks.app.tasks[f"bench.{contender}"]
    counter.set("done", 0)
    locks.client().flushall()
    started = time.perf_counter()
    for i in range(n):
        task.apply_async((round_no * 10_000_000 + i,))
    wait_until(lambda: int(counter.get("done") or 0) >= n, timeout=600, interval=0.002)
    return n / (time.perf_counter() - started)


def worker_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its live descendants.

    Read from ``/proc``; a pool child that exited is counted in its
    parent's ``cutime``/``cstime`` once reaped.
    """
    counters = tree_counters(pid)
    return counters["user"] + counters["system"]
