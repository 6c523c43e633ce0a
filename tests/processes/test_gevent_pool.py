"""`celery worker -P gevent`: greenlets and the native renewer thread never share a socket."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redislock import is_skipped
from tests.processes.test_crash import Cluster

pytest.importorskip("gevent")

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.fixture
def cluster(redis_server_factory: Any) -> Iterator[Cluster]:
    c = Cluster(redis_server_factory())
    yield c
    c.close()


def test_gevent_pool_releases_and_renews_every_lock(cluster: Cluster) -> None:
    worker = cluster.worker(ttl=30, pool="gevent", concurrency=50)
    random.seed(7)
    results = [
        cluster.send("green_hold", f"g{n % 60}", random.uniform(0.0, 0.5)) for n in range(600)
    ]
    outcomes = [result.get(timeout=60) for result in results]
    ran = [o for o in outcomes if not is_skipped(o)]
    log = worker.log()
    problems = [
        line
        for line in log.splitlines()
        if any(
            marker in line
            for marker in (
                "could not release",
                "could not renew",
                "was lost",
                "Cannot switch",
                "renewal tick failed",
                "renewer tick failed",
            )
        )
    ]
    summary = f"{len(ran)} ran, {sum(ran)} renewals, {len(problems)} problems"
    print(f"\n[measured] gevent -c 50: {summary}")
    assert problems == [], problems[:5]
    assert len(ran) >= 60 and sum(ran) > 0
    assert [k for k in cluster.locks.scan_iter("redislock:*") if not k.endswith(":fence")] == []
