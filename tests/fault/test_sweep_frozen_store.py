"""A frozen lock store never stalls a worker's main process through its sweep.

The sweep runs in a thread of its own: with the lock store SIGSTOPped, the
worker still answers its control channel at once (a sweep on the
consumer's event loop, as first built, held it for the store's timeouts
on every tick).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import LOCK_DB
from tests.processes.test_crash import Cluster
from tests.servers import RedisServer

pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.fault]


@pytest.fixture
def workers(redis_server_factory: Any) -> Iterator[Cluster]:
    started = Cluster(redis_server_factory())
    yield started
    started.close()


def test_a_worker_answers_at_once_while_its_lock_store_is_frozen(
    workers: Cluster, redis_server_factory: Any
) -> None:
    store: RedisServer = redis_server_factory()
    workers.worker(
        ttl=30, conf={"redislock_url": store.url_for(LOCK_DB), "redislock_sweep_interval": 0.5}
    )
    store.pause()
    try:
        latencies = []
        deadline = time.monotonic() + 6  # several sweep ticks against the frozen store
        while time.monotonic() < deadline:
            started = time.monotonic()
            replies = workers.producer.control.ping(timeout=5, limit=1)
            latencies.append(time.monotonic() - started if replies else 5.0)
    finally:
        store.resume()
    print(
        f"\n[measured] {len(latencies)} pings with the lock store frozen: median "
        f"{statistics.median(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms"
    )
    # A sweep on the event loop held it about 1 s on every tick (0.5 s here):
    # a dozen slow answers. One is allowed for a loaded machine.
    assert sum(latency > 0.5 for latency in latencies) <= 1
