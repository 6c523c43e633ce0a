"""Periodic jobs that must not overlap: real `celery beat` and worker processes."""

from __future__ import annotations

import itertools
import tempfile
from typing import Any

import pytest

from tests.brokers import queue_length
from tests.processes.test_crash import APP, Cluster, cluster  # noqa: F401  (fixture)
from tests.servers import CeleryWorkerProcess, wait_until

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def start_beat(
    c: Cluster, name: str, interval: float, expires: bool = False
) -> CeleryWorkerProcess:
    """A `celery beat` process (the worker wrapper runs any celery command)."""
    env = {"REDISLOCK_TEST_URL": c.server.url, "REDISLOCK_TEST_BEAT_INTERVAL": str(interval)}
    if expires:
        env["REDISLOCK_TEST_BEAT_EXPIRES"] = "1"
    schedule = tempfile.mktemp(prefix="redislock-beat-")
    beat = CeleryWorkerProcess(APP, env, name=name, command="beat", extra=("-s", schedule))
    c.workers.append(beat)
    return beat


def worker_with_beat_env(c: Cluster, interval: float, **kwargs: Any) -> CeleryWorkerProcess:
    env = {"REDISLOCK_TEST_URL": c.server.url, "REDISLOCK_TEST_BEAT_INTERVAL": str(interval)}
    worker = CeleryWorkerProcess(APP, env, name=f"w{len(c.workers)}", **kwargs)
    c.workers.append(worker)
    worker.wait_ready()
    return worker


def intervals(c: Cluster) -> list[tuple[int, int]]:
    pairs = [
        tuple(map(int, raw.split(":"))) for raw in c.record.lrange("periodic:intervals", 0, -1)
    ]
    return sorted(pairs)  # type: ignore[arg-type]


def assert_no_overlap(c: Cluster) -> int:
    runs = intervals(c)
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(runs)), runs
    assert max(int(p) for p in c.record.lrange("periodic:peak", 0, -1)) == 1
    return len(runs)


def test_a_3s_job_every_1s_never_overlaps_and_skips_visibly(cluster: Cluster) -> None:  # noqa: F811
    worker_with_beat_env(cluster, 1.0, concurrency=2)
    start_beat(cluster, "beat", 1.0)
    # Three runs take 9 s at least; meanwhile beat sends ~9 messages.
    wait_until(lambda: cluster.record.llen("periodic:intervals") >= 3, timeout=40)
    runs = assert_no_overlap(cluster)
    skips = int(cluster.record.get("contended:skip") or 0)
    print(f"\n[measured] 1 s beat, 3 s job: {runs} runs, {skips} skipped, 0 overlaps")
    assert skips >= 2  # skipped runs are reported through lock_contended


def test_two_beats_by_mistake_still_never_overlap(cluster: Cluster) -> None:  # noqa: F811
    worker_with_beat_env(cluster, 1.0, concurrency=2)
    worker_with_beat_env(cluster, 1.0, concurrency=2)
    start_beat(cluster, "beat1", 1.0)
    start_beat(cluster, "beat2", 1.0)
    wait_until(lambda: cluster.record.llen("periodic:intervals") >= 3, timeout=40)
    runs = assert_no_overlap(cluster)
    skips = int(cluster.record.get("contended:skip") or 0)
    print(f"\n[measured] two beats, 4 worker processes: {runs} runs, {skips} skipped, 0 overlaps")
    assert skips >= 4


def test_expires_equal_to_the_interval_drops_the_backlog(cluster: Cluster) -> None:  # noqa: F811
    # One worker process: without expires the 1 s sends would queue up behind
    # each 3 s run and then run late, back to back.
    worker_with_beat_env(cluster, 1.0, concurrency=1)
    beat = start_beat(cluster, "beat", 1.0, expires=True)
    wait_until(lambda: cluster.record.llen("periodic:intervals") >= 2, timeout=40)
    beat.stop()
    wait_until(
        lambda: int(cluster.record.get("expired") or 0) >= 2,
        timeout=30,
        message="queued runs to expire instead of running late",
    )
    wait_until(lambda: queue_length(cluster.producer) == 0, timeout=30)
    wait_until(lambda: int(cluster.record.get("periodic:active") or 0) == 0, timeout=30)
    runs = assert_no_overlap(cluster)
    expired = int(cluster.record.get("expired") or 0)
    print(f"\n[measured] backlog behind a 3 s run at 1 s interval: {runs} runs, {expired} expired")
