"""Exceptions landing anywhere in a Redis call never cause a wrong grant or a mixed-up reply.

The storm (``storm.py``) runs in its own process, so its SIGALRM handler
never disturbs pytest. Its size comes from ``REDISLOCK_STORM_CYCLES``
(10,000 by default); the command in docs/_parts/tests.md runs 100,000.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import LOCK_DB
from tests.servers import ROOT, RedisServer

CYCLES = int(os.environ.get("REDISLOCK_STORM_CYCLES", "10000"))


def test_signal_storm_never_gives_a_wrong_grant_or_a_misattributed_renewal(
    server: RedisServer,
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.integration.storm", server.url_for(LOCK_DB), str(CYCLES)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n[measured] storm: {counts}")
    assert counts["cycles"] == CYCLES
    assert counts["interrupts"] > CYCLES // 10, "the storm must actually interrupt calls"
    assert counts["grants"] > CYCLES // 10
    assert counts["renewals"] > 0
    assert counts["task_runs"] > CYCLES // 10
    faults = {
        name: counts[name]
        for name in (
            "wrong_grants",
            "foreign_grants",
            "unexpected_errors",
            "kept_lost",
            "kept_missing",
            "lost_signals",
            "renewer_complaints",
            "task_wrong_grants",
            "task_keys_left",
            "task_foreign_touched",
        )
    }
    assert faults == dict.fromkeys(faults, 0), out.stderr


pytestmark = pytest.mark.slow
