"""Scenario 5: crash recovery, seconds until a duplicate runs after a kill.

Three kills: the pool child running the task; the whole worker, with a
spare worker (another node name) to run the duplicate; and, for this
package only, the whole worker restarted under the same node name (``-n``),
as systemd or a pod with a stable hostname does, where start-up recovery
(``redislock_recover_on_start``) frees the dead run's lock. For that kill the
figure is the time from the restarted worker's ``ready`` to the duplicate's
start, with the time from the kill (which includes the worker's own start)
beside it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, NamedTuple

import redis

from bench.harness import reset_peer_globals
from bench.report import Report
from tests.servers import CeleryWorkerProcess, RedisServer, wait_until

#: The kill after which the same node restarts (this package's contenders only).
RESTARTED = "whole worker, restarted with the same -n"
#: The kills by their ``--crash-kills`` names.
KILLS = {"child": "pool child", "worker": "whole worker", "restarted": RESTARTED}


class Outcome(NamedTuple):
    """When the duplicate started, if it did within the cap."""

    after_kill: float | None
    #: Only for :data:`RESTARTED`: from the restarted worker's ``ready``.
    after_ready: float | None = None


def crash_recovery(
    report: Report,
    rounds: int,
    cap: float,
    contenders: list[str],
    variants: tuple[str, ...] = ("default", "ttl60"),
    kills: tuple[str, ...] = ("child", "worker", "restarted"),
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
                chosen = [KILLS[name] for name in kills]
                if not contender.startswith("redislock"):
                    # The peers have no start-up recovery.
                    chosen = [kill for kill in chosen if kill != RESTARTED]
                ttl = crash_tasks.TTL_NOTE[(contender, variant)]
                for kill in chosen:
                    for _round_no in range(rounds):
                        outcome = _crash_once(
                            crash_tasks, broker, locks, record, contender, variant, kill, cap
                        )
                        _add(report, scenario, f"{contender} ({ttl})", kill, outcome, cap)
                        shown = outcome.after_kill
                        print(
                            f"  {contender} {variant} {kill}: "
                            f"{f'{shown:.2f}s' if shown is not None else f'> {cap:g}s'}"
                            + (
                                f" ({outcome.after_ready:.3f}s after ready)"
                                if outcome.after_ready is not None
                                else ""
                            ),
                            flush=True,
                        )
    finally:
        broker.close()
        locks.close()


def _add(
    report: Report, scenario: str, contender: str, kill: str, outcome: Outcome, cap: float
) -> None:
    def seconds(metric: str, value: float | None, note: str = "") -> None:
        missing = f"no duplicate within {cap:g}s"
        found = value is not None
        report.add(
            scenario,
            contender,
            metric,
            "s",
            value if value is not None else float("inf"),
            note=note if found else missing,
        )

    if kill != RESTARTED:
        seconds(f"{kill} SIGKILL", outcome.after_kill)
        return
    seconds(f"{RESTARTED}: ready → duplicate", outcome.after_ready, "start-up recovery")
    seconds(f"{RESTARTED}: kill → duplicate", outcome.after_kill, "includes the worker's own start")


def _crash_once(
    crash_tasks: Any,
    broker: RedisServer,
    locks: RedisServer,
    record: redis.Redis,
    contender: str,
    variant: str,
    kill: str,
    cap: float,
) -> Outcome:
    broker.client().flushall()
    locks.client().flushall()
    task = crash_tasks.app.tasks[f"crash.{contender}.{variant}"]
    spare: CeleryWorkerProcess | None = None
    env = {"BENCH_BROKER_URL": broker.url, "BENCH_LOCK_URL": locks.url}

    def start_first() -> CeleryWorkerProcess:
        return CeleryWorkerProcess(
            "bench.crash_tasks", env, concurrency=1, name="crash-a", own_group=True
        )

    first = start_first()
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
        record.delete("pid", "runs", "at")
        if kill == "pool child":
            os.kill(pid, signal.SIGKILL)
        else:
            first.kill_group()
        killed, killed_wall = time.monotonic(), time.time()
        waiting_since = killed
        ready_at: float | None = None
        if kill == RESTARTED:
            first.close()
            first = start_first()  # the same node name: crash-a@<host>
            first.wait_ready()
            ready_at, waiting_since = first.ready_at(), time.monotonic()
        # The cap bounds the wait for the duplicate (after the restart, if any).
        while time.monotonic() - waiting_since < cap:
            _send(task)  # a duplicate, as the next webhook or beat tick would send it
            if record.get("pid"):
                if ready_at is None:
                    return Outcome(time.monotonic() - killed)
                # From the body's own clock reading: not rounded up to this loop's polls.
                started = float(record.get("at") or 0)
                return Outcome(started - killed_wall, started - ready_at)
            time.sleep(0.25)
        return Outcome(None)
    finally:
        first.close()
        if spare is not None:
            spare.close()


def _send(task: Any) -> None:
    with contextlib.suppress(Exception):  # celery-once raises AlreadyQueued for a duplicate
        task.apply_async(("same-key",))
