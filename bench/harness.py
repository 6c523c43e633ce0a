"""What every scenario shares: peers, round-trip counting, bench workers."""

from __future__ import annotations

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
