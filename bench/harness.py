"""What every scenario shares: peers, round-trip counting, bench workers."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tests.servers import CeleryWorkerProcess, RedisServer, wait_until


def peers_available() -> dict[str, bool]:
    found = {}
    for module in ("celery_singleton", "celery_once", "redis_lock", "pottery"):
        try:
            __import__(module)
            found[module] = True
        except ImportError:
            found[module] = False
    return found


def reset_peer_globals() -> None:
    """Forget the peers' module-global Redis clients (first URL wins in both).

    celery-singleton and celery-once cache one client per process; a scenario
    that starts new servers must drop them or the peers talk to a dead one.
    """
    try:
        import celery_singleton.backends as singleton_backends

        singleton_backends._backend = None  # type: ignore[attr-defined]
    except ImportError:
        pass
    try:
        import celery_once.backends.redis as once_redis

        once_redis.redis = None  # type: ignore[attr-defined]
    except ImportError:
        pass


def server_cost(server: RedisServer, action: Callable[[], None]) -> tuple[float, float]:
    """``(µs, commands)`` the lock store's server spent executing during ``action``.

    From its own ``INFO commandstats`` (reset first): the execution time of
    every command, and how many ran, those a Lua script runs included (its
    ``EVALSHA`` counts once more: the server's own accounting). What one
    Redis core can serve is bounded by this time, whatever the clients.
    The ``CONFIG RESETSTAT`` and ``INFO`` of the measurement are left out.
    """
    client = server.client()
    try:
        client.config_resetstat()
        action()
        stats = client.info("commandstats")
    finally:
        client.close()
    usec = calls = 0.0
    for name, row in stats.items():
        if name in (
            "cmdstat_info",
            "cmdstat_config|resetstat",
            "cmdstat_config",
            "cmdstat_flushall",
        ):
            continue
        usec += float(row["usec"])
        calls += float(row["calls"])
    return usec, calls


def count_round_trips(server: RedisServer, action: Callable[[], None]) -> int:
    """Top-level commands the lock store received during ``action`` (MONITOR).

    Commands run inside Lua scripts are shown by MONITOR as ``[... lua]`` and
    are not round trips, so they are left out.
    """
    lines: list[str] = []
    ready = threading.Event()
    stop = threading.Event()

    def monitor() -> None:
        client = server.client()
        with client.monitor() as m:
            ready.set()
            for event in m.listen():
                command = str(event.get("command", ""))
                if stop.is_set() and command.startswith("ECHO bench-monitor-end"):
                    return
                if event.get("client_type") != "lua" and not command.startswith("ECHO bench-"):
                    lines.append(command)

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    ready.wait(5)
    time.sleep(0.1)  # MONITOR is registered once its first reply arrived
    action()
    stop.set()
    server.client().echo("bench-monitor-end")
    thread.join(10)
    return len(lines)


@contextmanager
def worker(
    broker: RedisServer, locks: RedisServer, pool: str, concurrency: int
) -> Iterator[CeleryWorkerProcess]:
    env = {"BENCH_BROKER_URL": broker.url, "BENCH_LOCK_URL": locks.url}
    process = CeleryWorkerProcess(
        "bench.tasks",
        env,
        pool=pool,
        concurrency=concurrency,
        name=f"bench-{pool}",
        extra=("--loglevel", "WARNING"),
    )
    try:
        from bench import tasks

        wait_until(lambda: tasks.app.control.ping(timeout=0.3), timeout=60, interval=0.1)
        yield process
    finally:
        process.close()


def tree_counters(pid: int) -> dict[str, float]:
    """CPU seconds (user, system), context switches, and the parent's own CPU, of a process tree."""
    tick = os.sysconf("SC_CLK_TCK")
    totals = {"user": 0.0, "system": 0.0, "switches": 0.0, "parent": 0.0}
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            # fields[11..14]: utime, stime, cutime, cstime (stat(5) fields 14-17)
            totals["user"] += (int(fields[11]) + int(fields[13])) / tick
            totals["system"] += (int(fields[12]) + int(fields[14])) / tick
            if current == pid:
                totals["parent"] = (int(fields[11]) + int(fields[12])) / tick
            for thread in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{thread}/status") as status:
                    for line in status:
                        if "ctxt_switches" in line:  # voluntary and nonvoluntary
                            totals["switches"] += int(line.split()[1])
                with open(f"/proc/{current}/task/{thread}/children") as children:
                    pending.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return totals
