"""The runnable examples run (against this test's own redis-server)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import LOCK_DB
from tests.servers import ROOT, RedisServer


@pytest.mark.parametrize("module", ["examples.fencing", "examples.standalone_lock"])
def test_example_runs(module: str, server: RedisServer) -> None:
    env = {**os.environ, "REDIS_URL": server.url_for(LOCK_DB), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", module],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    if module == "examples.fencing":
        assert "new holder writes 90: True" in done.stdout
        assert "old holder (woke up) writes 50: False" in done.stdout
        assert "balance: (90," in done.stdout
    else:
        assert "index rebuilt; lock still ours: True" in done.stdout
        assert "compacted" in done.stdout
        assert "posted refund-42 at depth 2" in done.stdout
        assert "ledger free again: True" in done.stdout
        assert "async report built; lock still ours: True" in done.stdout
