"""Benchmarks: celery-redislock against its peers, side by side in one run.

    make bench                      # or: python -m bench.run [--rounds 5] [--smoke]

The defaults (3 rounds, 1 crash round capped at 65 s) take about 30 minutes
on 2 cores; most of it is scenario 5 waiting out the peers that never free
a crashed worker's key. ``--rounds 5 --crash-rounds 5 --crash-cap 75`` gives
more rounds in about 80 minutes.

Every scenario runs each contender in the same run, on Redis servers this
script starts on free ports, and reports the median and min-max over the
rounds plus the ratio to the scenario's baseline measured in the same
round. Results: a Markdown table on stdout and in bench/results/results.md,
and JSON in bench/results/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import peers_available  # noqa: E402
from bench.report import Report  # noqa: E402
from bench.scenarios.crash import crash_recovery  # noqa: E402
from bench.scenarios.hand_off import hand_off  # noqa: E402
from bench.scenarios.lock_cycle import lock_cycle  # noqa: E402
from bench.scenarios.overhead import per_task_overhead  # noqa: E402
from bench.scenarios.renewal import renewal_at_scale  # noqa: E402
from bench.scenarios.task_handoff import bodies_per_storm, task_hand_off  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--crash-rounds", type=int, default=1)
    parser.add_argument(
        "--crash-cap",
        type=float,
        default=65.0,
        help="longest wait for a duplicate after a kill (s); above the 60 s TTL of 'ttl60'",
    )
    parser.add_argument(
        "--crash-kills",
        default="child,worker,restarted",
        help="scenario 5's kills: child, worker (a spare worker runs the duplicate), "
        "restarted (the whole worker restarted with the same -n; this package only)",
    )
    parser.add_argument("--only", default="1,2,3,4,5,6,7", help="scenario numbers, e.g. 1,2")
    parser.add_argument(
        "--contenders",
        default="",
        help="scenario 1's contenders, e.g. plain,floor (the floor alone); default: all",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the bench runs")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    only = {int(x) for x in args.only.split(",")}
    if args.smoke:
        args.rounds, args.tasks, args.crash_rounds, args.crash_cap = 1, 40, 1, 1.0
    available = peers_available()
    contenders = ["plain", "floor", "redislock", "redislock_limit3"] + [
        name
        for name, module in (
            ("celery_singleton", "celery_singleton"),
            ("celery_once", "celery_once"),
        )
        if available[module]
    ]
    overhead_contenders = contenders
    if args.contenders:
        overhead_contenders = ["plain", *(c for c in args.contenders.split(",") if c != "plain")]
        unknown = sorted(set(overhead_contenders) - set(contenders))
        if unknown:
            parser.error(f"unknown or unavailable contenders {unknown}; known: {contenders}")
    report = Report()
    started = time.time()
    print(f"peers installed: {available}", flush=True)
    scenarios: list[tuple[int, str, Callable[[], None]]] = [
        (
            1,
            "per-task overhead",
            lambda: per_task_overhead(report, args.rounds, args.tasks, overhead_contenders),
        ),
        (
            2,
            "lock cycle",
            lambda: lock_cycle(
                report, args.rounds, 0.3 if args.smoke else 2.0, 200 if args.smoke else 20_000
            ),
        ),
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
                # A smoke run checks the scenario runs: this package only.
                ["redislock"]
                if args.smoke
                else [c for c in contenders if c not in ("plain", "floor", "redislock_limit3")],
                ("default",) if args.smoke else ("default", "ttl60"),
                kills=tuple(args.crash_kills.split(",")),
            ),
        ),
        (
            6,
            "task hand-off latency",
            lambda: task_hand_off(report, args.rounds, 3 if args.smoke else 20, args.smoke),
        ),
        (
            7,
            "bodies per storm",
            lambda: bodies_per_storm(
                report,
                args.rounds,
                30 if args.smoke else 1000,
                0.5 if args.smoke else 5.0,
                args.smoke,
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
