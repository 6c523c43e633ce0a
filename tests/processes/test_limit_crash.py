"""``lock_limit``: the worker's parent frees the slot a killed pool child held."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.processes.test_crash import Cluster
from tests.servers import wait_until

pytestmark = [pytest.mark.subprocess, pytest.mark.slow, pytest.mark.fault]


@pytest.fixture
def cluster(redis_server_factory: Any) -> Iterator[Cluster]:
    c = Cluster(redis_server_factory())
    yield c
    # The holders left sleep for a minute: end the workers at once (the
    # server is this test's own) rather than wait out a warm shutdown.
    for worker in c.workers:
        for pid in worker.children():
            with contextlib.suppress(ProcessLookupError):  # exited since it was listed
                os.kill(pid, signal.SIGKILL)
        worker.signal(signal.SIGKILL)
    c.close()


def start_two(cluster: Cluster, name: str) -> tuple[dict[str, str], dict[str, str]]:
    """Start two holders of one key; return (slot 1's, slot 2's) started records."""
    first = cluster.send("hold_limited", name, 60)
    first_info = cluster.started(first.id)
    second = cluster.send("hold_limited", name, 60)
    second_info = cluster.started(second.id)
    second_info["task_id"] = second.id
    assert second_info["key"] == first_info["key"] + ":slot:2"
    return first_info, second_info


def test_sigkill_of_the_child_holding_slot_2_frees_that_slot(cluster: Cluster) -> None:
    worker = cluster.worker(ttl=30, concurrency=3)
    first, second = start_two(cluster, "slot-kill")
    killed_at = time.monotonic()
    os.kill(int(second["pid"]), signal.SIGKILL)
    # TTL is 30 s: only the parent's release (by owner, in whichever slot) frees it this early.
    wait_until(
        lambda: cluster.locks.exists(second["key"]) == 0,
        timeout=20,
        interval=0.05,
        message="parent to release the dead child's slot",
    )
    freed_after = time.monotonic() - killed_at
    print(f"\n[measured] lock_limit=3: slot 2 freed {freed_after:.2f}s after SIGKILL (TTL 30s)")
    assert freed_after < 15
    assert cluster.locks.exists(first["key"]) == 1  # slot 1's holder still runs and holds it
    assert "after its process" in worker.log()
    third = cluster.send("hold_limited", "slot-kill", 0)
    assert third.get(timeout=30) == third.id


def test_terminate_of_the_slot_2_holder_frees_it_before_revoked(cluster: Cluster) -> None:
    cluster.worker(ttl=30, concurrency=3)
    first, second = start_two(cluster, "slot-revoke")
    result = cluster.producer.AsyncResult(second["task_id"])
    cluster.producer.control.revoke(second["task_id"], terminate=True)
    wait_until(lambda: result.state == "REVOKED", timeout=20, message="REVOKED stored")
    assert cluster.locks.exists(second["key"]) == 0  # released before REVOKED was stored
    assert cluster.locks.exists(first["key"]) == 1
