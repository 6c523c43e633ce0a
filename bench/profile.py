"""Where a locked task's worker time goes: CPU, system calls and context switches per task.

    python -m bench.profile [--tasks 3000] [--reps 3] [--strace] [--out DIR]
    py-spy record -r 2000 -f raw -o spy.txt -- python -m bench.profile --tracer-only --tasks 40000
    python -m bench.profile --samples spy.txt      # where the locked task's own time goes

A plain no-op task against the same task with ``base=SingletonTask``, side by
side in one run:

1. **In one thread, through Celery's tracer** (what a worker calls per
   task, with the worker's start-up optimizations installed), client CPU
   with ``process_time``: what the lock adds with no worker, broker or
   other thread around it.
2. **In a real ``celery worker``** (``threads -c 4`` and ``prefork -c 2``),
   read from ``/proc`` for the worker's whole process tree: user and system
   CPU, context switches (voluntary and involuntary, every thread), and the
   parent's own CPU, per task. With ``--strace``, a second pass counts the
   system calls per task by name (``strace -c -f``; it slows everything, so
   its time columns are not used).

Results: Markdown on stdout and in ``DIR/profile.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import tree_counters, worker  # noqa: E402
from bench.scenarios.overhead import _drain  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

CONTENDERS = ("plain", "redislock")


def tracer_cpu(tasks: int, reps: int) -> dict[str, list[float]]:
    """Client CPU (µs) per task through Celery's tracer, one thread, plain vs locked."""
    from celery import Celery
    from celery.app.trace import (
        build_tracer,
        reset_worker_optimizations,
        setup_worker_optimizations,
    )

    from celery_redislock import SingletonTask

    server = RedisServer()
    app = Celery("profile", broker="memory://", backend=None)
    try:
        app.conf.update(redislock_url=f"{server.url}/0", task_ignore_result=True)

        @app.task(name="profile.plain")
        def plain(n: int) -> None:
            return None

        @app.task(name="profile.redislock", base=SingletonTask)
        def redislock(n: int) -> None:
            return None

        # What `celery worker` does at start: among others, it replaces
        # Task.__call__ with one that runs the body directly under the tracer.
        setup_worker_optimizations(app, "profile@localhost")
        tracers = {
            name: build_tracer(task.name, task, app=app, eager=False, propagate=True)
            for name, task in (("plain", plain), ("redislock", redislock))
        }

        def run(name: str, count: int, first: int) -> float:
            trace = tracers[name]
            started = time.process_time()
            for n in range(first, first + count):
                task_id = str(uuid.uuid4())
                # As a worker's request has it: its node name (the lock's value names it).
                request = {
                    "id": task_id,
                    "hostname": "profile@localhost",
                    "delivery_info": {"routing_key": "celery"},
                }
                trace(task_id, (n,), {}, request)
            return (time.process_time() - started) / count * 1e6

        for name in CONTENDERS:
            run(name, 500, 0)  # warm: connections, scripts cached
        out: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for rep in range(reps):
            for name in CONTENDERS:
                out[name].append(run(name, tasks, (rep + 1) * 10_000_000))
        return out
    finally:
        reset_worker_optimizations(app)
        server.close()


def summarize_samples(path: Path, root: str = "SingletonTaskMixin.__call__", top: int = 30) -> str:
    """Self time per function under ``root`` in py-spy's raw (collapsed) samples, as Markdown.

    ``root`` is the locked task's ``__call__``: the lock's own work and the
    (no-op) body, without Celery's tracer around them.
    """
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        starts = [i for i, frame in enumerate(frames) if frame.startswith(root)]
        if not starts:
            continue
        total += int(count)
        name, _, where = frames[-1].partition(" (")
        function = f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]}"
        own[function + ")"] = own.get(function + ")", 0) + int(count)
    lines = [f"{total} samples under `{root}`; self time per function:", ""]
    lines += ["| share | function |", "|---|---|"]
    for function, count in sorted(own.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"| {100 * count / total:.1f} % | `{function}` |")
    return "\n".join(lines)


@contextmanager
def traced(pids: list[int], path: Path) -> Iterator[None]:
    """Count the system calls of ``pids`` (and their threads) while the block runs."""
    command = ["strace", "-c", "-f", "-o", str(path)]
    for pid in pids:
        command += ["-p", str(pid)]
    tracer = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # strace attaches asynchronously; nothing to wait on but time
    try:
        yield
    finally:
        tracer.terminate()
        tracer.wait(30)


def syscall_counts(path: Path) -> dict[str, int]:
    """``strace -c``'s table as {system call: calls}."""
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            counts[parts[-1]] = int(parts[3])
    return counts


def worker_profile(
    pool: str, concurrency: int, tasks: int, reps: int, strace: bool, out: Path
) -> tuple[dict[str, list[dict[str, float]]], dict[str, dict[str, int]]]:
    broker, locks = RedisServer(), RedisServer()
    os.environ["BENCH_BROKER_URL"], os.environ["BENCH_LOCK_URL"] = broker.url, locks.url
    import importlib

    from bench import tasks as bench_tasks

    bench_tasks = importlib.reload(bench_tasks)
    bench_tasks.app.conf.update(broker_url=f"{broker.url}/0", redislock_url=f"{locks.url}/0")
    counter = broker.client(3)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    calls: dict[str, dict[str, int]] = {}
    try:
        with worker(broker, locks, pool, concurrency) as process:
            for name in CONTENDERS:
                _drain(bench_tasks, name, 300, counter, locks, 90)
            for rep in range(reps):
                for name in CONTENDERS:
                    before = tree_counters(process.pid)
                    rate = _drain(bench_tasks, name, tasks, counter, locks, rep)
                    after = tree_counters(process.pid)
                    row = {key: (after[key] - before[key]) / tasks for key in after}
                    row["rate"] = rate
                    rows[name].append(row)
            if strace:
                for name in CONTENDERS:
                    path = out / f"strace-{pool}-{name}.txt"
                    with traced(_tree(process.pid), path):
                        _drain(bench_tasks, name, tasks, counter, locks, 77)
                    calls[name] = {
                        call: count for call, count in syscall_counts(path).items() if count
                    }
    finally:
        broker.close()
        locks.close()
    return rows, calls


def _tree(pid: int) -> list[int]:
    pids = [pid]
    for thread in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{thread}/children") as children:
            pids.extend(int(child) for child in children.read().split())
    return pids


def _median(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    middle, low, high = (v * scale for v in (statistics.median(values), min(values), max(values)))
    return f"{middle:,.{digits}f} ({low:,.{digits}f}-{high:,.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--strace", action="store_true", help="also count system calls per task")
    parser.add_argument(
        "--samples",
        metavar="FILE",
        help="summarize py-spy's raw samples of a --tracer-only run, then stop",
    )
    parser.add_argument(
        "--tracer-only",
        action="store_true",
        help="only the one-thread tracer loop (to run under a sampling profiler such as py-spy)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "profile"))
    args = parser.parse_args()
    if args.samples:
        print(summarize_samples(Path(args.samples)))
        return 0
    # Each worker section reloads bench.tasks for its own servers; Celery warns
    # of the re-registered names when it finalizes, outside any block.
    from celery.exceptions import DuplicateTaskNameWarning

    warnings.simplefilter("ignore", DuplicateTaskNameWarning)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Where a locked task's worker time goes", ""]
    lines += [
        f"`python -m bench.profile --tasks {args.tasks} --reps {args.reps}"
        + (" --strace" if args.strace else "")
        + "`, median (min-max) per task.",
        "",
    ]

    cpu = tracer_cpu(args.tasks, args.reps)
    lines += ["## One thread, through Celery's tracer (client CPU, µs per task)", ""]
    lines += ["| task | CPU | added by the lock |", "|---|---|---|"]
    added = [lock - plain for lock, plain in zip(cpu["redislock"], cpu["plain"], strict=True)]
    lines += [f"| plain | {_median(cpu['plain'])} | |"]
    lines += [f"| SingletonTask | {_median(cpu['redislock'])} | {_median(added)} |", ""]
    print("\n".join(lines), flush=True)
    if args.tracer_only:
        return 0

    metrics = (
        ("tasks/s", "rate", 1.0),
        ("user CPU (µs)", "user", 1e6),
        ("system CPU (µs)", "system", 1e6),
        ("parent's own CPU (µs)", "parent", 1e6),
        ("context switches", "switches", 1.0),
    )
    digits = {"switches": 1}
    for pool, concurrency in (("threads", 4), ("prefork", 2)):
        rows, calls = worker_profile(pool, concurrency, args.tasks, args.reps, args.strace, out)
        section = [f"## `celery worker -P {pool} -c {concurrency}`, {args.tasks} no-op tasks", ""]
        section += ["| per task | plain | SingletonTask | added |", "|---|---|---|---|"]
        for label, key, scale in metrics:
            plain = [row[key] for row in rows["plain"]]
            locked = [row[key] for row in rows["redislock"]]
            difference = [b - a for a, b in zip(plain, locked, strict=True)]
            places = digits.get(key, 0)
            section += [
                f"| {label} | {_median(plain, scale, places)} | {_median(locked, scale, places)} | "
                f"{_median(difference, scale, places) if key != 'rate' else ''} |"
            ]
        if calls:
            section += ["", "System calls per task (`strace -c -f`, one pass):", ""]
            section += ["| call | plain | SingletonTask |", "|---|---|---|"]
            names = sorted(
                set(calls["plain"]) | set(calls["redislock"]),
                key=lambda call: -calls["redislock"].get(call, 0),
            )
            for call in names:
                plain_calls = calls["plain"].get(call, 0) / args.tasks
                locked_calls = calls["redislock"].get(call, 0) / args.tasks
                section += [f"| {call} | {plain_calls:.2f} | {locked_calls:.2f} |"]
        section += [""]
        print("\n".join(section), flush=True)
        lines += section
    (out / "profile.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
