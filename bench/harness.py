"""What every scenario shares: peers, round-trip counting, bench workers."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class ServerCost:
    """What ``action`` cost the lock store's server, from its own counters."""

    #: µs executing the commands the clients sent (a script's inner commands
    #: are inside its ``EVALSHA``'s time, and are not counted again).
    execution_us: float
    #: Commands the server ran, those inside scripts included.
    commands: float
    #: µs of the server's main thread (``INFO cpu``): execution, and reading,
    #: parsing and answering each round trip.
    cpu_us: float

    def __add__(self, other: ServerCost) -> ServerCost:
        return ServerCost(
            self.execution_us + other.execution_us,
            self.commands + other.commands,
            self.cpu_us + other.cpu_us,
        )


#: Rows of ``INFO commandstats`` the measurement itself adds.
_MEASUREMENT_ROWS = ("info", "config|resetstat", "config", "flushall", "monitor", "echo")


def server_cost(
    server: RedisServer, action: Callable[[], None], origins: dict[str, tuple[int, int]]
) -> ServerCost:
    """What the lock store's server spent while ``action`` ran.

    From its own ``INFO commandstats`` and ``INFO cpu`` (reset and read
    around ``action``). The server counts a command run inside a Lua script
    twice in time: in its own row and inside the script's ``EVALSHA``. So a
    row's time counts only in the share of its calls that the clients sent,
    as ``origins`` (:func:`command_origins` over the same action) says: the
    ``get`` and ``del`` a release script runs are in its ``EVALSHA``, a
    ``SET`` the client sends is its own. ``commands`` counts both.
    """
    client = server.client()
    try:
        client.config_resetstat()
        before = _main_thread_cpu(client)
        action()
        spent = _main_thread_cpu(client) - before
        stats = client.info("commandstats")
    finally:
        client.close()
    usec = calls = 0.0
    for row_name, row in stats.items():
        name = row_name.removeprefix("cmdstat_")
        if name in _MEASUREMENT_ROWS:
            continue
        sent, in_scripts = origins.get(name.split("|")[0], (1, 0))
        usec += float(row["usec"]) * sent / ((sent + in_scripts) or 1)
        calls += float(row["calls"])
    return ServerCost(usec, calls, spent * 1e6)


def _main_thread_cpu(client: Any) -> float:
    info = client.info("cpu")
    if "used_cpu_user_main_thread" in info:
        return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def command_origins(server: RedisServer, action: Callable[[], None]) -> dict[str, tuple[int, int]]:
    """``{command: (sent by clients, run inside scripts)}`` while ``action`` ran (MONITOR).

    MONITOR shows the commands a Lua script runs as ``[... lua]``; the
    clients' own commands are their round trips.
    """
    seen: dict[str, list[int]] = {}
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
                if command.startswith("ECHO bench-"):
                    continue
                name = command.split(" ", 1)[0].lower()
                counts = seen.setdefault(name, [0, 0])
                counts[event.get("client_type") == "lua"] += 1

    thread = threading.Thread(target=monitor, daemon=True)
    thread.start()
    ready.wait(5)
    time.sleep(0.1)  # MONITOR is registered once its first reply arrived
    action()
    stop.set()
    server.client().echo("bench-monitor-end")
    thread.join(10)
    return {name: (sent, in_scripts) for name, (sent, in_scripts) in seen.items()}


def round_trips(origins: dict[str, tuple[int, int]]) -> int:
    """The commands the clients sent (not those scripts ran): their round trips."""
    return sum(sent for sent, _ in origins.values())


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
