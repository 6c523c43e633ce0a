"""Scenarios 6 and 7: contended executions of one key in real workers.

6. Hand-off latency: a holder and a queue of duplicates of one key; the
   latency of each duplicate is its body's start minus the previous body's
   end (the release follows the end within microseconds). ``handoff`` parks
   (no worker slot), ``wait`` blocks a worker slot on pub/sub, ``retry``
   re-sends after the holder's remaining TTL (3 s here, to keep the bench
   short; 30 s at defaults).
7. Bodies per storm: N calls spread over S seconds against a body of B
   seconds that reads a counter the caller bumps before each call. Reports
   how many bodies ran and whether the last one saw the final value
   (1 = no lost update).
"""

from __future__ import annotations

import importlib
import itertools
import os
import time
from typing import Any

from bench.harness import reset_peer_globals, worker
from bench.report import Report, percentile
from tests.servers import RedisServer, wait_until

_POOLS = (("prefork", 2), ("threads", 4))


def _tasks(broker: RedisServer, locks: RedisServer) -> Any:
    os.environ["BENCH_BROKER_URL"], os.environ["BENCH_LOCK_URL"] = broker.url, locks.url
    from bench import tasks

    tasks = importlib.reload(tasks)
    reset_peer_globals()
    return tasks


def task_hand_off(report: Report, rounds: int, waiters: int, smoke: bool = False) -> None:
    broker, locks = RedisServer(), RedisServer()
    tasks = _tasks(broker, locks)
    record = broker.client(3, decode_responses=True)
    try:
        # A smoke run only checks that it runs: one pool, no 3 s Retry waits.
        pools = _POOLS[1:] if smoke else _POOLS
        contenders = ("handoff", "wait") if smoke else ("handoff", "wait", "retry")
        for pool, concurrency in pools:
            scenario = f"6. task hand-off latency ({pool} -c {concurrency}, {waiters} duplicates)"
            with worker(broker, locks, pool, concurrency):
                for round_no in range(rounds):
                    line = []
                    for contender in contenders:
                        gaps = _gaps(tasks, record, contender, waiters, f"{pool}-{round_no}")
                        p50, p99 = percentile(gaps, 0.5) * 1000, percentile(gaps, 0.99) * 1000
                        report.add(scenario, contender, "p50", "ms", p50)
                        report.add(scenario, contender, "p99", "ms", p99)
                        line.append(f"{contender} p50 {p50:.1f} ms p99 {p99:.1f} ms")
                    print(f"  {pool} round {round_no + 1}/{rounds}: " + "; ".join(line), flush=True)
    finally:
        broker.close()
        locks.close()


def _gaps(tasks: Any, record: Any, contender: str, waiters: int, group: str) -> list[float]:
    task = tasks.app.tasks[f"bench.contended_{contender}"]
    name = f"spans:{contender}"
    record.delete(name)
    task.apply_async((group, "holder", 0.5))
    wait_until(lambda: record.llen(name) == 0 and _locked(tasks), timeout=30, interval=0.005)
    for n in range(waiters):
        task.apply_async((group, f"w{n}", 0.05))
    wait_until(lambda: record.llen(name) >= waiters + 1, timeout=600, interval=0.01)
    spans = sorted(
        tuple(float(x) for x in row.split("|")[:2]) for row in record.lrange(name, 0, -1)
    )
    for (_, end), (next_start, _) in itertools.pairwise(spans):
        assert next_start >= end, f"{contender}: two bodies overlapped"
    return [next_start - end for (_, end), (next_start, _) in itertools.pairwise(spans)]


def _locked(tasks: Any) -> bool:
    import redis

    client = redis.Redis.from_url(tasks.app.conf.redislock_url)
    try:
        return any(True for _ in client.scan_iter(match="redislock:bench.contended_*", count=100))
    finally:
        client.close()


def bodies_per_storm(
    report: Report, rounds: int, calls: int, seconds: float, smoke: bool = False
) -> None:
    broker, locks = RedisServer(), RedisServer()
    tasks = _tasks(broker, locks)
    record = broker.client(3, decode_responses=True)
    body = 0.25
    try:
        for pool, concurrency in _POOLS[1:] if smoke else _POOLS:
            scenario = (
                f"7. storm ({pool} -c {concurrency}, {calls} calls over {seconds:g} s, "
                f"{body} s body)"
            )
            with worker(broker, locks, pool, concurrency):
                for round_no in range(rounds):
                    line = []
                    for contender in ("until_start", "until_done", "debounce"):
                        bodies, last_saw_final = _storm(
                            tasks,
                            record,
                            contender,
                            calls,
                            seconds,
                            body,
                            f"{pool}-{round_no}",
                            settle=2.0 if smoke else max(10.0, 4 * body + 5),
                        )
                        report.add(scenario, contender, "bodies", "runs", bodies)
                        report.add(
                            scenario,
                            contender,
                            "last body saw the final value",
                            "1/0",
                            float(last_saw_final),
                        )
                        line.append(f"{contender} {bodies} bodies, final seen {last_saw_final}")
                    print(f"  {pool} round {round_no + 1}/{rounds}: " + "; ".join(line), flush=True)
    finally:
        broker.close()
        locks.close()


def _storm(
    tasks: Any,
    record: Any,
    contender: str,
    calls: int,
    seconds: float,
    body: float,
    group: str,
    settle: float,
) -> tuple[int, bool]:
    task = tasks.app.tasks[f"bench.storm_{contender}"]
    name = f"seen:{contender}"
    record.delete(name, "counter")
    deadline = time.time() + seconds
    for n in range(calls):
        record.incr("counter")
        task.apply_async((group, body))
        pause = (deadline - time.time()) / (calls - n)
        if pause > 0:
            time.sleep(pause)
    final = int(record.get("counter"))

    def settled() -> bool:
        rows = record.lrange(name, -1, -1)
        return bool(rows) and int(rows[0].split("|")[1]) == final

    try:
        # until_done never settles (its last body misses the final value):
        # this bounds how long it is given.
        wait_until(settled, timeout=settle, interval=0.02)
        saw_final = True
    except AssertionError:
        saw_final = False
    time.sleep(body * 2)  # a run still queued would show up now (observation only)
    return record.llen(name), saw_final
