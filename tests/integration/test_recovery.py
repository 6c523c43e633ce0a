"""Start-up recovery against a real redis-server: what is released, what never is."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock.keys import queued_key, slot_key
from celery_redislock.recovery import process_started_ms, recover_at_start, recover_locks
from celery_redislock.settings import app_settings
from celery_redislock.tokens import LockOwner, LockValue
from tests.helpers import held
from tests.servers import free_port

NODE = "w1@recovery-host"
TASK = "tests.recovery.job"
RECOVERY_LOGGER = "celery_redislock.recovery"


def now_ms() -> int:
    return int(time.time() * 1000)


def dead_pid() -> int:
    """A pid no process has any more (a child that exited and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process on this host that is not part of the test."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def put(
    client: redis.Redis,
    key: str,
    *,
    host: str = NODE,
    pid: int | None,
    acquired_ms: int,
    task_id: str = "t-1",
) -> str:
    value = LockValue(LockOwner(task_id, 0, host, pid), "ab" * 16, TASK, acquired_ms).encode()
    assert client.set(key, value, px=60_000)
    return value


def key(name: str) -> str:
    return f"redislock:{TASK}:{{{name}}}"


def test_only_this_nodes_dead_holders_are_released(
    app: Celery, lock_client: redis.Redis, sleeper: subprocess.Popen[bytes], caplog: Any
) -> None:
    # The live process started before the locks that name it were taken.
    sleeper_started = process_started_ms(sleeper.pid)
    assert sleeper_started
    taken = max(sleeper_started, now_ms()) + 2_000
    worker_started = taken + 5_000
    dead = dead_pid()
    put(lock_client, key("dead"), pid=dead, acquired_ms=taken, task_id="dead-1")
    put(lock_client, key("alive"), pid=sleeper.pid, acquired_ms=taken)
    put(lock_client, key("me"), pid=os.getpid(), acquired_ms=taken)
    put(lock_client, key("other-host"), host="w1@another-host", pid=dead, acquired_ms=taken)
    put(lock_client, key("other-worker"), host="w2@recovery-host", pid=dead, acquired_ms=taken)
    put(lock_client, key("since-start"), pid=dead, acquired_ms=worker_started + 1)
    lock_client.set(key("foreign"), "not a lock value of ours", px=60_000)
    kept = ("alive", "me", "other-host", "other-worker", "since-start", "foreign")
    keep = [key(name) for name in kept]
    before = {k: lock_client.get(k) for k in keep}

    with caplog.at_level(logging.INFO, logger=RECOVERY_LOGGER):
        released = recover_locks(app, NODE, worker_started)

    assert [record.key for record in released] == [key("dead")]
    assert lock_client.exists(key("dead")) == 0
    assert {k: lock_client.get(k) for k in keep} == before
    (line,) = [r for r in caplog.records if r.name == RECOVERY_LOGGER]
    assert line.levelno == logging.WARNING
    message = line.getMessage()
    for part in (key("dead"), TASK, "dead-1", f"pid {dead}", NODE):
        assert part in message


def test_a_reused_pid_a_process_started_after_the_lock_was_taken_is_released(
    app: Celery, lock_client: redis.Redis, sleeper: subprocess.Popen[bytes]
) -> None:
    sleeper_started = process_started_ms(sleeper.pid)
    assert sleeper_started
    # The lock names the sleeper's pid but was taken ten seconds before it
    # started: its holder was an earlier process with that pid.
    put(lock_client, key("reused"), pid=sleeper.pid, acquired_ms=sleeper_started - 10_000)
    released = recover_locks(app, NODE, now_ms())
    assert [record.key for record in released] == [key("reused")]
    assert lock_client.exists(key("reused")) == 0
    assert sleeper.poll() is None  # nothing happens to the process itself


def test_queued_kept_and_parked_values_are_never_released(
    app: Celery, lock_client: redis.Redis
) -> None:
    values = {
        key("queued"): LockValue.queued("q-1", TASK).encode(),
        queued_key(key("coalesced")): LockValue.queued("q-2", TASK).encode(),
        key("kept"): LockValue.kept("k-1", 0, TASK).encode(),
        key("parked"): LockValue.parked("p-1", 0, TASK).encode(),
    }
    for name, value in values.items():
        lock_client.set(name, value, px=60_000)
    assert recover_locks(app, NODE, now_ms() + 60_000) == []
    assert {name: lock_client.get(name).decode() for name in values} == values


def test_each_slot_of_an_at_most_n_key_is_released_on_its_own(
    app: Celery, lock_client: redis.Redis, sleeper: subprocess.Popen[bytes]
) -> None:
    base = key("limited")
    taken = now_ms() - 5_000
    dead_one, dead_two = dead_pid(), dead_pid()
    put(lock_client, slot_key(base, 1), pid=dead_one, acquired_ms=taken, task_id="s-1")
    alive = put(lock_client, slot_key(base, 2), pid=sleeper.pid, acquired_ms=now_ms() + 1_000)
    put(lock_client, slot_key(base, 3), pid=dead_two, acquired_ms=taken, task_id="s-3")
    released = recover_locks(app, NODE, now_ms() + 2_000)
    assert sorted((record.key, record.slot) for record in released) == [
        (slot_key(base, 1), 1),
        (slot_key(base, 3), 3),
    ]
    assert lock_client.exists(slot_key(base, 1), slot_key(base, 3)) == 0
    assert lock_client.get(slot_key(base, 2)).decode() == alive


def test_a_released_key_is_handed_to_the_call_parked_behind_it(
    app: Celery, lock_client: redis.Redis
) -> None:
    store = app_settings(app).backend
    handed: list[tuple[str, str, bytes]] = []
    store.on_handoff = lambda k, waiter, message: handed.append((k, waiter, message))
    holder = put(lock_client, key("parked-on"), pid=dead_pid(), acquired_ms=now_ms() - 5_000)
    parked = store.park(key("parked-on"), "v-waiter", 60_000, "handoff-1", "c", b"msg", 60_000)
    assert parked.parked and parked.result.holder == holder

    released = recover_locks(app, NODE, now_ms())

    assert [record.key for record in released] == [key("parked-on")]
    assert held(lock_client, key("parked-on")) == b"handoff-1"
    assert handed == [(key("parked-on"), "handoff-1", b"msg")]


def test_a_lock_changed_since_it_was_read_is_left_alone(
    app: Celery, lock_client: redis.Redis
) -> None:
    """The release compares the whole value: a successor's value is never deleted."""
    from celery_redislock.admin import LockInventory

    put(lock_client, key("changed"), pid=dead_pid(), acquired_ms=now_ms() - 5_000)
    inventory = LockInventory(app)
    (record,) = inventory.locks()
    successor = put(lock_client, key("changed"), host="w2@x", pid=1, acquired_ms=now_ms())
    assert inventory.release(record, log=False).name == "NOT_OURS"
    assert lock_client.get(key("changed")).decode() == successor


def test_an_unreachable_store_is_a_warning_not_an_error(
    app_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = app_factory(redislock_url=f"redis://127.0.0.1:{free_port()}/0")
    with caplog.at_level(logging.INFO, logger=RECOVERY_LOGGER):
        assert recover_at_start(app, NODE, now_ms()) is None
    (line,) = [r for r in caplog.records if r.name == RECOVERY_LOGGER]
    assert line.levelno == logging.WARNING
    assert f"left by a previous run of {NODE} were not recovered" in line.getMessage()


def test_the_summary_line_says_how_many_were_recovered(
    app: Celery, lock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=RECOVERY_LOGGER):
        assert recover_at_start(app, NODE, now_ms()) == 0
        put(lock_client, key("a"), pid=dead_pid(), acquired_ms=now_ms() - 5_000)
        put(lock_client, key("b"), pid=dead_pid(), acquired_ms=now_ms() - 5_000)
        assert recover_at_start(app, NODE, now_ms()) == 2
    records = [r for r in caplog.records if r.name == RECOVERY_LOGGER]
    assert [r.levelname for r in records] == ["INFO", "WARNING", "WARNING", "INFO"]
    lines = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert lines[0].startswith(f"celery-redislock: found no locks left by a previous run of {NODE}")
    assert lines[1].startswith(
        f"celery-redislock: recovered 2 locks left by a previous run of {NODE}"
    )


def test_a_key_of_another_type_under_the_prefix_does_not_stop_recovery(
    app: Celery, lock_client: redis.Redis
) -> None:
    """Someone's list under the lock prefix is no lock: skipped, the dead lock still released."""
    taken = now_ms() - 10_000
    put(lock_client, key("dead"), pid=dead_pid(), acquired_ms=taken)
    lock_client.rpush("redislock:some-other-list", "x")
    lock_client.hset(f"redislock:{TASK}:{{hash}}", "a", "b")
    released = recover_locks(app, NODE, now_ms())
    assert [record.key for record in released] == [key("dead")]
    assert lock_client.llen("redislock:some-other-list") == 1
