"""The benchmark runs end to end at tiny sizes (numbers are not checked: speed
belongs to bench/, never to a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokers import redis_broker_only
from tests.servers import ROOT

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.slow,
    redis_broker_only("the benchmarks start their own Redis broker (bench/common.py)"),
]


@pytest.mark.timeout(420)
def test_bench_smoke(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    scenarios = {figure["scenario"].split(".")[0] for figure in results["figures"]}
    assert scenarios == {"1", "2", "3", "4", "5", "6", "7"}
    ours = [f for f in results["figures"] if "redislock" in f["contender"]]
    assert ours and all(f["rounds"] >= 1 for f in ours)
    assert (tmp_path / "results.md").read_text().startswith("# Benchmark results")
