"""Start-up recovery's decision (pure) and its view of the processes on this host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from celery_redislock.recovery import (
    START_SLACK_MS,
    UNKNOWN_START,
    Decision,
    decide,
    process_started_ms,
)
from celery_redislock.tokens import KEPT_HOST, PARKED_HOST, QUEUED_HOST, LockOwner, LockValue
from tests.servers import wait_until

NODE = "w1@host-a"
WORKER_STARTED = 1_700_000_100_000  # ms
ACQUIRED = WORKER_STARTED - 60_000  # a minute before this worker started


def value(
    host: str = NODE, pid: int | None = 4321, acquired: int = ACQUIRED, task_id: str = "t-1"
) -> LockValue:
    return LockValue(LockOwner(task_id, 0, host, pid), "n" * 32, "tasks.sync", acquired)


def no_process(pid: int) -> int | None:
    return None


def started_at(ms: int) -> Callable[[int], int | None]:
    return lambda pid: ms


def test_a_dead_holder_of_this_node_taken_before_this_worker_started_is_released() -> None:
    assert decide(value(), NODE, WORKER_STARTED, no_process) is Decision.RELEASE


def test_a_live_holder_that_started_before_it_took_the_lock_is_kept() -> None:
    live = started_at(ACQUIRED - 5_000)
    assert decide(value(), NODE, WORKER_STARTED, live) is Decision.HOLDER_RUNS


def test_a_live_process_whose_start_time_is_unknown_counts_as_the_holder() -> None:
    unknown = started_at(UNKNOWN_START)
    assert decide(value(), NODE, WORKER_STARTED, unknown) is Decision.HOLDER_RUNS


def test_a_reused_pid_a_process_started_after_the_lock_was_taken_is_released() -> None:
    reused = started_at(ACQUIRED + START_SLACK_MS + 1)
    assert decide(value(), NODE, WORKER_STARTED, reused) is Decision.RELEASE


def test_a_process_started_within_the_clock_slack_after_the_lock_counts_as_its_holder() -> None:
    close = started_at(ACQUIRED + START_SLACK_MS)
    assert decide(value(), NODE, WORKER_STARTED, close) is Decision.HOLDER_RUNS


def test_this_worker_process_itself_holds_what_it_took_after_it_started() -> None:
    # Our own pid: a lock we took (after we started) is never ours to recover.
    ours = value(acquired=WORKER_STARTED + 10)
    assert decide(ours, NODE, WORKER_STARTED, started_at(WORKER_STARTED)) is (
        Decision.TAKEN_SINCE_START
    )


def test_our_own_pid_on_a_lock_taken_long_before_we_started_is_a_previous_run() -> None:
    # A container restarts its worker with the same pid (the entrypoint is
    # pid 1); with the solo or threads pool the old lock names that pid.
    assert decide(value(pid=1), NODE, WORKER_STARTED, started_at(WORKER_STARTED)) is (
        Decision.RELEASE
    )


def test_another_node_name_is_never_released_even_with_a_dead_pid() -> None:
    for other in ("w2@host-a", "w1@host-b", "w1@host-a.example", "W1@host-a", ""):
        assert decide(value(host=other), NODE, WORKER_STARTED, no_process) is Decision.OTHER_NODE


@pytest.mark.parametrize("host", [QUEUED_HOST, KEPT_HOST, PARKED_HOST])
def test_queued_kept_and_parked_values_are_never_released(host: str) -> None:
    assert decide(value(host=host, pid=None), NODE, WORKER_STARTED, no_process) is (
        Decision.NOT_RUNNING
    )
    # Even a worker named like a special host (impossible: node names have an "@").
    assert decide(value(host=host), host, WORKER_STARTED, no_process) is Decision.NOT_RUNNING


def test_a_lock_taken_after_this_worker_started_is_kept() -> None:
    # A concurrently running worker wrongly sharing the node name.
    for acquired in (WORKER_STARTED, WORKER_STARTED + 1, WORKER_STARTED + 60_000):
        later = value(acquired=acquired)
        assert decide(later, NODE, WORKER_STARTED, no_process) is Decision.TAKEN_SINCE_START


def test_values_without_a_pid_or_not_ours_to_read_are_kept() -> None:
    assert decide(value(pid=None), NODE, WORKER_STARTED, no_process) is Decision.NO_PROCESS
    assert decide(value(pid=0), NODE, WORKER_STARTED, no_process) is Decision.NO_PROCESS
    assert decide(None, NODE, WORKER_STARTED, no_process) is Decision.UNKNOWN_VALUE


def test_liveness_is_only_asked_for_this_nodes_candidates() -> None:
    asked: list[int] = []

    def spy(pid: int) -> int | None:
        asked.append(pid)
        return None

    decide(value(host="w2@host-a", pid=11), NODE, WORKER_STARTED, spy)
    decide(value(pid=12, acquired=WORKER_STARTED + 1), NODE, WORKER_STARTED, spy)
    decide(value(pid=13), NODE, WORKER_STARTED, spy)
    assert asked == [13]


# -- process_started_ms: /proc on this host -------------------------------------


def test_this_process_started_before_now_and_after_the_boot() -> None:
    started = process_started_ms(os.getpid())
    assert started is not None
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc: start times are unknown")
    now = time.time() * 1000
    assert 0 < started <= now
    # The test process started at most the length of a long test run ago.
    assert now - started < 24 * 3600 * 1000


def test_a_child_started_now_reads_as_started_now() -> None:
    before = time.time() * 1000
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = process_started_ms(child.pid)
        after = time.time() * 1000
        assert started is not None
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc: start times are unknown")
        # Clock ticks (10 ms) and the boot time's precision.
        assert before - 1_000 <= started <= after
    finally:
        child.kill()
        child.wait()


def test_an_exited_process_is_not_running() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid is free
    assert process_started_ms(child.pid) is None


def test_a_zombie_is_not_running() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        if not os.path.isdir("/proc/self"):
            pytest.skip("no /proc")

        def zombie() -> bool:
            with open(f"/proc/{child.pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] == "Z"

        wait_until(zombie, timeout=10, message="the child to exit")
        assert process_started_ms(child.pid) is None
    finally:
        child.wait()


def test_no_pid_is_not_a_process() -> None:
    assert process_started_ms(0) is None
    assert process_started_ms(-1) is None


def test_without_proc_a_live_pid_counts_as_live_and_a_dead_one_as_dead(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    from celery_redislock import recovery

    monkeypatch.setattr(recovery, "PROC", f"{tmp_path}/no-proc")
    assert process_started_ms(os.getpid()) == UNKNOWN_START
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_started_ms(child.pid) is None
