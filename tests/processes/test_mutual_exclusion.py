"""At most one execution per key at any moment, across worker processes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from celery import group

from tests.processes.test_crash import Cluster, cluster  # noqa: F401  (fixture)

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

KEYS = 2
PER_KEY = 250


def test_500_contended_executions_never_overlap(cluster: Cluster) -> None:  # noqa: F811
    cluster.worker(ttl=5, concurrency=2)
    cluster.worker(ttl=5, concurrency=2)
    calls = [(f"k{n % KEYS}", n) for n in range(KEYS * PER_KEY)]
    signature = cluster.producer.signature
    job = group(signature("tests.processes.app.exclusive", args=call) for call in calls)
    results = job.apply_async().get(timeout=300)
    assert sorted(results) == list(range(KEYS * PER_KEY))

    pids: set[str] = set()
    for k in range(KEYS):
        key = f"k{k}"
        peaks = [int(p) for p in cluster.record.lrange(f"peak:{key}", 0, -1)]
        assert len(peaks) == PER_KEY
        assert max(peaks) == 1, f"{key}: {max(peaks)} bodies ran at once"
        intervals: list[Any] = []
        for raw in cluster.record.lrange(f"intervals:{key}", 0, -1):
            start, end, pid = raw.split(":")
            intervals.append((int(start), int(end)))
            pids.add(pid)
        intervals.sort()
        overlaps = sum(1 for a, b in itertools.pairwise(intervals) if b[0] < a[1])
        assert overlaps == 0
    assert len(pids) >= 2, "executions must be spread over several processes"
    waits = int(cluster.record.get("contended:wait") or 0)
    print(
        f"\n[measured] {KEYS * PER_KEY} executions over {len(pids)} processes; "
        f"{waits} waits for a held lock; 0 overlaps"
    )
    assert waits >= len(calls) // 10, "the test must actually contend"
