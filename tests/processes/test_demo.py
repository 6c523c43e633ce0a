"""The README's demo command runs end to end and leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.brokers import redis_broker_only
from tests.servers import ROOT

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.slow,
    redis_broker_only("the README's demo starts its own Redis as broker and lock store"),
]


def _descendants() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {
        int(line.split()[0])
        for line in out.splitlines()
        if "examples.app" in line or "redislock-demo-" in line
    }


def test_demo_prints_a_summary_with_no_overlap() -> None:
    before = _descendants()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--duration", "4", "--payments", "3"],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env=env,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max concurrent executions per key = 1" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("payment webhooks"))
    enqueued, executed, deduplicated, _retried = row.split()[2:]
    # 3 payments x 3 concurrent deliveries + 3 late redeliveries: one run each.
    assert (enqueued, executed, deduplicated) == ("12", "3", "9")
    assert "OK: no key ever ran twice at once" in done.stdout
    assert _descendants() - before == set()  # no stray workers, beat or redis-server
