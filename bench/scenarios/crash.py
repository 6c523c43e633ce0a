"""Scenario 5: crash recovery, seconds until a duplicate runs after a kill."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

import redis

from bench.harness import reset_peer_globals
from bench.report import Report
from tests.servers import CeleryWorkerProcess, RedisServer, wait_until


def crash_recovery(
    report: Report,
    rounds: int,
    cap: float,
    contenders: list[str],
    variants: tuple[str, ...] = ("default", "ttl60"),
) -> None:
    broker, locks = RedisServer(), RedisServer()
    os.environ["BENCH_BROKER_URL"], os.environ["BENCH_LOCK_URL"] = broker.url, locks.url
    from bench import crash_tasks

    reset_peer_globals()
    crash_tasks.app.conf.update(
        broker_url=f"{broker.url}/0",
        redislock_url=f"{locks.url}/0",
        singleton_backend_url=f"{locks.url}/0",
    )
    record = broker.client(3, decode_responses=True)
    scenario = "5. crash recovery (30 s task; seconds until a duplicate runs)"
    try:
        for variant in variants:
            for contender in contenders:
                for kill in ("pool child", "whole worker"):
                    for _round_no in range(rounds):
                        seconds = _crash_once(
                            crash_tasks, broker, locks, record, contender, variant, kill, cap
                        )
                        ttl = crash_tasks.TTL_NOTE[(contender, variant)]
                        shown = seconds if seconds is not None else float("inf")
                        report.add(
                            scenario,
                            f"{contender} ({ttl})",
                            f"{kill} SIGKILL",
                            "s",
                            shown,
                            note="" if seconds is not None else f"no duplicate within {cap:g}s",
                        )
                        print(
                            f"  {contender} {variant} {kill}: "
                            f"{f'{seconds:.2f}s' if seconds is not None else f'> {cap:g}s'}",
                            flush=True,
                        )
    finally:
        broker.close()
        locks.close()


def _crash_once(
    crash_tasks: Any,
    broker: RedisServer,
    locks: RedisServer,
    record: redis.Redis,
    contender: str,
    variant: str,
    kill: str,
    cap: float,
) -> float | None:
    broker.client().flushall()
    locks.client().flushall()
    task = crash_tasks.app.tasks[f"crash.{contender}.{variant}"]
    spare: CeleryWorkerProcess | None = None
    env = {"BENCH_BROKER_URL": broker.url, "BENCH_LOCK_URL": locks.url}
    first = CeleryWorkerProcess("bench.crash_tasks", env, concurrency=1, name="crash-a")
    try:
        first.wait_ready()
        if kill == "whole worker":
            spare = CeleryWorkerProcess("bench.crash_tasks", env, concurrency=1, name="crash-b")
            spare.wait_ready()
        _send(task)
        try:
            pid = int(wait_until(lambda: record.get("pid"), timeout=30))
        except AssertionError as exc:
            raise RuntimeError(f"{contender} task did not start:\n{first.log()[-3000:]}") from exc
        record.delete("pid", "runs")
        if kill == "pool child":
            os.kill(pid, signal.SIGKILL)
        else:
            for child in first.children():
                os.kill(child, signal.SIGKILL)
            first.signal(signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < cap:
            _send(task)  # a duplicate, as the next webhook or beat tick would send it
            if record.get("pid"):
                return time.monotonic() - killed
            time.sleep(0.25)
        return None
    finally:
        first.close()
        if spare is not None:
            spare.close()


def _send(task: Any) -> None:
    with contextlib.suppress(Exception):  # celery-once raises AlreadyQueued for a duplicate
        task.apply_async(("same-key",))
