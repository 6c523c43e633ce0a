"""Benchmarks: celery-redislock against its peers, side by side in one run.

    make bench                      # or: python -m bench.run [--rounds 5] [--smoke]

Every scenario runs each contender in the same run, on Redis servers this
script starts on free ports, and reports the median and min-max over the
rounds plus the ratio to the scenario's baseline measured in the same
round. Results: a Markdown table on stdout and in bench/results/results.md,
and JSON in bench/results/results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celery_redislock import RedisLock  # noqa: E402
from celery_redislock.renewal import renewer  # noqa: E402
from tests.servers import CeleryWorkerProcess, RedisServer, wait_until  # noqa: E402

RESULTS = ROOT / "bench" / "results"


# -- results ----------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured quantity of one contender over the rounds."""

    scenario: str
    contender: str
    metric: str
    unit: str
    values: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    note: str = ""

    def summary(self) -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float] | None:
            if not xs:
                return None
            return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

        return {
            "scenario": self.scenario,
            "contender": self.contender,
            "metric": self.metric,
            "unit": self.unit,
            "rounds": len(self.values),
            "values": self.values,
            "value": stats(self.values),
            "ratio": stats(self.ratios),
            "note": self.note,
        }


class Report:
    def __init__(self) -> None:
        self.figures: dict[tuple[str, str, str], Figure] = {}

    def add(
        self,
        scenario: str,
        contender: str,
        metric: str,
        unit: str,
        value: float,
        ratio: float | None = None,
        note: str = "",
    ) -> None:
        key = (scenario, contender, metric)
        figure = self.figures.setdefault(key, Figure(scenario, contender, metric, unit, note=note))
        figure.values.append(value)
        if ratio is not None:
            figure.ratios.append(ratio)
        if note:
            figure.note = note

    def markdown(self) -> str:
        lines = [
            "| Scenario | Contender | Metric | Median | Min-max "
            "| Ratio to baseline (median, min-max) | Rounds | Note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for figure in self.figures.values():
            s = figure.summary()
            v, r = s["value"], s["ratio"]
            value = _fmt(v["median"]) if v else "—"
            spread = f"{_fmt(v['min'])}-{_fmt(v['max'])}" if v else "—"
            ratio = f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" if r else "—"
            lines.append(
                f"| {figure.scenario} | {figure.contender} | {figure.metric} ({figure.unit}) | "
                f"{value} | {spread} | {ratio} | {s['rounds']} | {figure.note} |"
            )
        return "\n".join(lines)


def _fmt(x: float) -> str:
    if x == float("inf"):
        return "∞"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.4f}"


def percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# -- helpers ----------------------------------------------------------------------------


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


# -- scenario 1: per-task overhead ------------------------------------------------------


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
            for round_no in range(rounds):
                with worker(broker, locks, pool, concurrency):
                    order = (
                        contenders[round_no % len(contenders) :]
                        + contenders[: round_no % len(contenders)]
                    )
                    rates: dict[str, float] = {}
                    for contender in order:
                        rates[contender] = _drain(tasks, contender, n, counter, locks, round_no)
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
                            trips = count_round_trips(
                                locks, lambda c=contender: _drain(tasks, c, 200, counter, locks, 99)
                            )
                            report.add(
                                scenario,
                                contender,
                                "lock-store round trips per task",
                                "commands",
                                trips / 200,
                            )
                print(
                    f"  {pool} round {round_no + 1}/{rounds}: "
                    + ", ".join(f"{c} {rates[c]:.0f}/s" for c in contenders),
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


# -- scenario 2: lock cycle -------------------------------------------------------------


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


# -- scenario 3: renewal at scale -------------------------------------------------------


def renewal_at_scale(report: Report, rounds: int, sizes: list[int], hold: float) -> None:
    server = RedisServer()
    client = server.client()
    available = peers_available()
    ttl = 3.0
    try:
        for size in sizes:
            scenario = f"3. renewal at scale ({size} locks, TTL {ttl:g}s, held {hold:g}s)"
            for round_no in range(rounds):
                server.client().flushall()
                locks = [RedisLock(client, f"renew:{round_no}:{i}", ttl=ttl) for i in range(size)]
                for lock in locks:
                    lock.acquire(blocking=False)
                trips_before, cpu_before = renewer().round_trips, time.process_time()
                handles = [lock.handle for lock in locks]
                time.sleep(hold)
                ticks = max(h.renewals for h in handles if h is not None)
                trips = renewer().round_trips - trips_before
                cpu = time.process_time() - cpu_before
                alive = sum(client.exists(lock.name) for lock in locks)
                lost = sum(lock.lost for lock in locks)
                for lock in locks:
                    lock.release()
                report.add(
                    scenario,
                    "celery-redislock (one renewer thread)",
                    "round trips per tick",
                    "round trips",
                    trips / max(ticks, 1),
                )
                report.add(
                    scenario,
                    "celery-redislock (one renewer thread)",
                    "locks per round trip",
                    "locks",
                    size * ticks / max(trips, 1),
                )
                report.add(
                    scenario,
                    "celery-redislock (one renewer thread)",
                    "process CPU per tick",
                    "ms",
                    1000 * cpu / max(ticks, 1),
                )
                report.add(
                    scenario,
                    "celery-redislock (one renewer thread)",
                    "locks expired or lost",
                    "locks",
                    (size - alive) + lost,
                )
            if size <= 1000 and available["redis_lock"]:
                _python_redis_lock_renewal(report, client, server, rounds, size, ttl, hold)
    finally:
        server.close()


def _python_redis_lock_renewal(
    report: Report,
    client: redis.Redis,
    server: RedisServer,
    rounds: int,
    size: int,
    ttl: float,
    hold: float,
) -> None:
    import redis_lock

    scenario = f"3. renewal at scale ({size} locks, TTL {ttl:g}s, held {hold:g}s)"
    for round_no in range(rounds):
        server.client().flushall()
        threads_before = threading.active_count()
        locks = [
            redis_lock.Lock(client, f"prl:{round_no}:{i}", expire=int(ttl), auto_renewal=True)
            for i in range(size)
        ]
        for lock in locks:
            lock.acquire(blocking=False)
        threads = threading.active_count() - threads_before
        died: list[str] = []
        previous_hook = threading.excepthook

        def record_death(args: Any, into: list[str] = died) -> None:
            into.append(type(args.exc_value).__name__)

        threading.excepthook = record_death
        stats_before = server.client().info("stats")["total_commands_processed"]
        cpu_before = time.process_time()
        time.sleep(hold)
        commands = server.client().info("stats")["total_commands_processed"] - stats_before
        cpu = time.process_time() - cpu_before
        alive = sum(client.exists(f"lock:prl:{round_no}:{i}") for i in range(size))
        for lock in locks:
            with contextlib.suppress(redis_lock.NotAcquired):  # it expired: counted above
                lock.release()
        threading.excepthook = previous_hook
        ticks = hold / (ttl * 2 / 3)
        name = "python-redis-lock (a thread per lock)"
        report.add(scenario, name, "renewal threads", "threads", threads)
        report.add(scenario, name, "round trips per tick", "round trips", commands / max(ticks, 1))
        report.add(scenario, name, "process CPU per tick", "ms", 1000 * cpu / max(ticks, 1))
        report.add(scenario, name, "locks expired or lost", "locks", size - alive)
        report.add(
            scenario,
            name,
            "renewal threads that died",
            "threads",
            len(died),
            note=", ".join(sorted(set(died))),
        )


# -- scenario 4: hand-off latency -------------------------------------------------------


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


# -- scenario 5: crash recovery ---------------------------------------------------------


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


# -- main -------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--crash-rounds", type=int, default=5)
    parser.add_argument(
        "--crash-cap",
        type=float,
        default=75.0,
        help="longest wait for a duplicate after a kill (s)",
    )
    parser.add_argument("--only", default="1,2,3,4,5", help="scenario numbers, e.g. 1,2")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the bench runs")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    only = {int(x) for x in args.only.split(",")}
    if args.smoke:
        args.rounds, args.tasks, args.crash_rounds, args.crash_cap = 1, 40, 1, 1.0
    available = peers_available()
    contenders = ["plain", "redislock"] + [
        name
        for name, module in (
            ("celery_singleton", "celery_singleton"),
            ("celery_once", "celery_once"),
        )
        if available[module]
    ]
    report = Report()
    started = time.time()
    print(f"peers installed: {available}", flush=True)
    scenarios: list[tuple[int, str, Callable[[], None]]] = [
        (
            1,
            "per-task overhead",
            lambda: per_task_overhead(report, args.rounds, args.tasks, contenders),
        ),
        (2, "lock cycle", lambda: lock_cycle(report, args.rounds, 0.3 if args.smoke else 2.0)),
        (
            3,
            "renewal at scale",
            lambda: renewal_at_scale(
                report,
                args.rounds,
                [50] if args.smoke else [1000, 10000],
                2.0 if args.smoke else 6.0,
            ),
        ),
        (4, "hand-off latency", lambda: hand_off(report, args.rounds, 5 if args.smoke else 40)),
        (
            5,
            "crash recovery",
            lambda: crash_recovery(
                report,
                args.crash_rounds,
                args.crash_cap,
                [c for c in contenders if c != "plain"],
                ("default",) if args.smoke else ("default", "ttl60"),
            ),
        ),
    ]
    failed: list[str] = []
    for number, name, run in scenarios:
        if number not in only:
            continue
        print(f"{number}. {name}", flush=True)
        try:
            run()
        except Exception as exc:  # keep the other scenarios' results
            failed.append(f"{number}. {name}: {type(exc).__name__}: {exc}")
            print(f"  FAILED: {failed[-1]}", flush=True)
    table = report.markdown()
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "redis": _redis_version(),
        "peers": available,
        "arguments": vars(args),
        "failed_scenarios": failed,
    }
    (out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "figures": [f.summary() for f in report.figures.values()]}, indent=2
        )
    )
    (out / "results.md").write_text(
        f"# Benchmark results\n\n{json.dumps(meta, indent=2)}\n\n{table}\n"
    )
    print(f"\nwritten to {out}/results.md and results.json ({meta['duration_s']} s)")
    return 1 if failed else 0


def _redis_version() -> str:
    server = RedisServer()
    try:
        return str(server.client().info("server")["redis_version"])
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
