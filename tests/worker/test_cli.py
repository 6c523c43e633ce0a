"""`celery redislock` against real servers: click's CliRunner and a real `celery` process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_redislock import SingletonTask
from celery_redislock.admin import LockInventory
from celery_redislock.cli import redislock
from celery_redislock.tokens import LockOwner, LockValue
from tests.brokers import worker_env
from tests.conftest import embedded_worker
from tests.helpers import hold_lock
from tests.servers import RedisServer, free_port, wait_until

pytestmark = pytest.mark.worker

ROOT = Path(__file__).resolve().parents[2]


def invoke(app: Celery, *args: str, input: str | None = None) -> Result:
    context = CLIContext(app=app, no_color=True, workdir=None, quiet=False)
    return CliRunner().invoke(redislock, list(args), obj=context, input=input)


@pytest.fixture
def sync(app: Celery) -> Any:
    @app.task(base=SingletonTask, shared=False, name="proj.sync", lock_ttl=30)
    def sync(account: int) -> None:
        pass

    return sync


def test_ls_with_nothing_held(app: Celery) -> None:
    result = invoke(app, "ls")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "no locks held"


def test_ls_shows_a_running_task_and_purge_keeps_it_while_it_is_renewed(
    app: Celery, record: redis.Redis, lock_client: redis.Redis
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, name="proj.long", lock_ttl=1.5)
    def long(self: Any, n: int) -> None:
        assert self.lock.fence > 0  # issued on demand: `ls` shows it from now on
        record.set("started", self.request.id)
        wait_until(lambda: record.exists("finish"), timeout=30)

    with embedded_worker(app, "threads", 2):
        running = long.delay(1)
        wait_until(lambda: record.get("started") == running.id, timeout=20)
        listed = json.loads(invoke(app, "ls", "--json", "--task", "proj.long").output)
        assert [item["task_id"] for item in listed] == [running.id]
        (mine,) = listed
        assert mine["state"] == "held" and mine["task_name"] == "proj.long"
        assert mine["pid"] == os.getpid() and mine["fence"] > 0
        assert 0 < mine["ttl_remaining"] <= 1.5 and mine["age"] >= 0
        # Outlive two TTLs: the lock is still there only because it is renewed.
        inventory = LockInventory(app)
        wait_until(lambda: (inventory.find(running.id).age() or 0) > 3.0, timeout=10)  # type: ignore[union-attr]
        purge = invoke(app, "purge", "--task", "proj.long", "--force")
        assert purge.exit_code == 0, purge.output
        assert lock_client.exists(mine["key"]) == 1, "a renewed lock was purged"
        record.set("finish", 1)
        running.get(timeout=20)
    assert "nothing to release for proj.long (1 live lock(s) kept)" in purge.output


def test_purge_releases_unrenewed_locks_and_keeps_live_ones(
    app: Celery, lock_client: redis.Redis, sync: Any
) -> None:
    dead, _ = hold_lock(lock_client, sync, (1,), holder_task_id="dead")
    lock_client.pexpire(dead, 15_000)  # 15 s without a renewal at TTL 30 (renewed every 10 s)
    fresh, _ = hold_lock(lock_client, sync, (2,), holder_task_id="fresh")
    other_task, _ = hold_lock(lock_client, sync, (3,), holder_task_id="other")
    lock_client.set(other_task, lock_client.get(other_task).replace(b"proj.sync", b"proj.other"))  # type: ignore[union-attr]
    lock_client.pexpire(other_task, 1000)

    refused = invoke(app, "purge", "--task", "proj.sync", input="n\n")
    assert refused.exit_code == 1 and "Aborted" in refused.output
    assert lock_client.exists(dead) == 1

    result = invoke(app, "purge", "--task", "proj.sync", "--force")
    assert result.exit_code == 0, result.output
    assert "released 1 lock(s) of proj.sync, kept 1 live" in result.output
    assert lock_client.exists(dead) == 0
    assert lock_client.exists(fresh) == 1
    assert lock_client.exists(other_task) == 1, "another task's lock was touched"

    everything = invoke(app, "purge", "--task", "proj.sync", "--force", "--include-live")
    assert everything.exit_code == 0 and "released 1 lock(s)" in everything.output
    assert lock_client.exists(fresh) == 0 and lock_client.exists(other_task) == 1


def _held_by_a_worker(client: redis.Redis, task_name: str, task_id: str, px: int) -> str:
    """A lock of ``task_name`` held by another worker, with ``px`` ms left; its key."""
    key = f"redislock:{task_name}:{{1}}"
    value = LockValue.new(LockOwner(task_id, 0, "celery@elsewhere", 1), task_name)
    client.set(key, value.encode(), px=px)
    return key


#: The app ``cli_included.py`` registers its task on (the last one).
INCLUDING: list[Celery] = []


def test_purge_knows_the_ttl_of_a_task_only_the_worker_imports(
    app_factory: Any, lock_client: redis.Redis
) -> None:
    """lock_ttl=3 under an app TTL of 30, in a module listed in ``include``.

    The CLI used to judge it by the app's 30 s: a lock renewed a second ago
    looked dead (review helper-29). This one has not been renewed for 2.5 s
    of its 3: dead by its own TTL, so purge takes it.
    """
    sys.modules.pop("tests.worker.cli_included", None)
    app = app_factory(include=["tests.worker.cli_included"], redislock_ttl=30)
    INCLUDING.append(app)
    key = _held_by_a_worker(lock_client, "proj.included", "stale", px=500)
    result = invoke(app, "purge", "--task", "proj.included", "--force")
    assert result.exit_code == 0, result.output
    assert "released 1 lock(s) of proj.included" in result.output
    assert lock_client.exists(key) == 0


def test_purge_keeps_a_lock_of_a_task_the_app_does_not_know(
    app: Celery, lock_client: redis.Redis
) -> None:
    # Its TTL is unknown: any remaining TTL may be a renewed lock's.
    key = _held_by_a_worker(lock_client, "proj.elsewhere", "running", px=2000)
    result = invoke(app, "purge", "--task", "proj.elsewhere", "--force")
    assert result.exit_code == 0, result.output
    assert "1 live lock(s) kept" in result.output
    assert lock_client.exists(key) == 1
    assert json.loads(invoke(app, "show", key, "--json").output)["live"] is True


def test_purge_keeps_an_idempotency_window_shorter_than_the_ttl(
    app: Celery, lock_client: redis.Redis, sync: Any
) -> None:
    # lock_hold_after_success=5 under lock_ttl=30: the kept key's TTL of 5 s
    # looked like 25 s without a renewal (review helper-29).
    key = sync.lock_key_for((1,), {})
    lock_client.set(key, LockValue.kept("done-1", 0, "proj.sync").encode(), px=5000)
    result = invoke(app, "purge", "--task", "proj.sync", "--force")
    assert result.exit_code == 0, result.output
    assert lock_client.exists(key) == 1
    assert json.loads(invoke(app, "show", key, "--json").output)["live"] is True


def test_show_by_key_and_by_task_id(app: Celery, lock_client: redis.Redis, sync: Any) -> None:
    key, value = hold_lock(lock_client, sync, (7,), holder_task_id="t-7")
    by_key = json.loads(invoke(app, "show", key, "--json").output)
    by_id = json.loads(invoke(app, "show", "t-7", "--json").output)
    changing = ("age", "ttl_remaining")
    assert {k: v for k, v in by_key.items() if k not in changing} == {
        k: v for k, v in by_id.items() if k not in changing
    }
    assert by_key["key"] == key and by_key["value"] == value
    assert by_key["hostname"] == "celery@elsewhere" and by_key["live"] is True
    text = invoke(app, "show", "t-7")
    assert text.exit_code == 0 and f"key:           {key}" in text.output

    missing = invoke(app, "show", "no-such-task")
    assert missing.exit_code == 1
    assert "no lock found for 'no-such-task'" in missing.output


def test_release_asks_first_logs_and_only_deletes_what_it_showed(
    app: Celery, lock_client: redis.Redis, sync: Any, caplog: pytest.LogCaptureFixture
) -> None:
    key, _ = hold_lock(lock_client, sync, (1,), holder_task_id="stuck")
    declined = invoke(app, "release", key, input="n\n")
    assert declined.exit_code == 1 and "held by task stuck (proj.sync)" in declined.output
    assert lock_client.exists(key) == 1

    with caplog.at_level(logging.WARNING, logger="celery_redislock.admin"):
        confirmed = invoke(app, "release", "stuck", input="y\n")
    assert confirmed.exit_code == 0 and f"released {key}" in confirmed.output
    assert lock_client.exists(key) == 0
    assert any("force-released lock" in r.message and key in r.message for r in caplog.records)

    # The lock changes hands between reading and releasing: left alone.
    hold_lock(lock_client, sync, (1,), holder_task_id="first")
    inventory = LockInventory(app)
    seen = inventory.find("first")
    assert seen is not None
    lock_client.delete(key)
    hold_lock(lock_client, sync, (1,), holder_task_id="second")
    assert inventory.release(seen).name == "NOT_OURS"
    assert inventory.find("second") is not None


def test_clear_errors_for_unreachable_redis_and_missing_settings(
    app_factory: Any, lock_client: redis.Redis
) -> None:
    down = app_factory(redislock_url=f"redis://127.0.0.1:{free_port()}/0")
    result = invoke(down, "ls")
    assert result.exit_code == 1
    assert "is unavailable" in result.output and "Traceback" not in result.output

    unset = Celery("unset", broker="amqp://guest@127.0.0.1:1//", set_as_current=False)
    result = invoke(unset, "ls")
    assert result.exit_code == 1 and "redislock_url is not set" in result.output


def test_listing_escapes_glob_characters_in_the_prefix(
    app_factory: Any, lock_client: redis.Redis
) -> None:
    app = app_factory(redislock_key_prefix="a*b")
    lock_client.set("a*b:mine:{1}", "x", px=10_000)
    lock_client.set("aXb:other:{1}", "x", px=10_000)
    keys = [r.key for r in LockInventory(app).locks()]
    assert keys == ["a*b:mine:{1}"]
    assert LockInventory(app).locks()[0].state == "unknown"


@pytest.mark.subprocess
def test_real_celery_command(server: RedisServer, lock_client: redis.Redis) -> None:
    env = {
        **os.environ,
        **worker_env(),
        "REDISLOCK_TEST_URL": server.url,
        "PYTHONPATH": str(ROOT),
    }
    celery = [sys.executable, "-m", "celery", "-A", "tests.processes.app"]
    help_text = subprocess.run(
        [sys.executable, "-m", "celery", "--help"], capture_output=True, text=True, env=env
    )
    assert "redislock" in help_text.stdout

    sys.path.insert(0, str(ROOT))
    from tests.processes.app import app as process_app

    task = process_app.tasks["tests.processes.app.hold"]
    key, _ = hold_lock(lock_client, task, ("cli", 1.0), holder_task_id="from-cli-test")
    listed = subprocess.run(
        [*celery, "redislock", "ls", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    assert [item["task_id"] for item in json.loads(listed.stdout)] == ["from-cli-test"]

    table = subprocess.run(
        [*celery, "redislock", "ls"], capture_output=True, text=True, env=env, timeout=60
    )
    assert table.stdout.splitlines()[0].split()[:3] == ["KEY", "TASK", "TASK"]
    assert key in table.stdout and "from-cli-test" in table.stdout

    released = subprocess.run(
        [*celery, "redislock", "release", key, "--force"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert released.returncode == 0, released.stderr
    assert lock_client.exists(key) == 0
    bad = subprocess.run(
        [*celery, "redislock", "show", "nothing-here"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 1 and "no lock found" in bad.stderr
    wrong_app = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.processes.nothing", "redislock", "ls"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert wrong_app.returncode == 2 and "Unable to load celery application" in wrong_app.stderr


def test_ls_lists_standalone_reentrant_and_async_locks_held_under_the_prefix(
    app: Celery, lock_client: redis.Redis, server: RedisServer
) -> None:
    """They store an ordinary string value: the inventory and `ls` read them like any lock."""
    import asyncio

    import redis.asyncio

    from celery_redislock import AsyncRedisLock, RedisLock
    from celery_redislock.aiostore import AsyncLockStore
    from tests.conftest import LOCK_DB

    prefix = LockInventory(app).prefix
    reentrant = RedisLock(lock_client, f"{prefix}:cron:nested", ttl=30, reentrant=True)
    assert reentrant.acquire() and reentrant.acquire()
    assert (reentrant.fence or 0) > 0  # fences are issued on demand

    async def held_by_async_lock() -> Result:
        client = redis.asyncio.Redis(port=server.port, db=LOCK_DB)
        try:
            async with AsyncRedisLock(client, f"{prefix}:web:report", ttl=30) as held:
                assert await held.fence() > 0
                return await asyncio.to_thread(invoke, app, "ls", "--json")
        finally:
            await AsyncLockStore.for_client(client).aclose()
            await client.aclose()

    try:
        result = asyncio.run(held_by_async_lock())
    finally:
        reentrant.release()
        reentrant.release()
    assert result.exit_code == 0, result.output
    listed = {item["key"]: item for item in json.loads(result.output)}
    assert set(listed) == {f"{prefix}:cron:nested", f"{prefix}:web:report"}
    assert all(item["pid"] == os.getpid() and item["fence"] > 0 for item in listed.values())
    assert lock_client.exists(f"{prefix}:cron:nested") == 0


def test_a_task_module_that_fails_to_import_does_not_stop_the_cli(
    app_factory: Any, lock_client: redis.Redis
) -> None:
    # A dependency missing on the operator's host: ls failed with the
    # ModuleNotFoundError, in the incident the CLI is for (review helper-30).
    app = app_factory(include=["tests.worker.no_such_module_here"])
    key = _held_by_a_worker(lock_client, "proj.elsewhere", "stuck", px=30000)
    result = invoke(app, "ls", "--json")
    assert result.exit_code == 0, result.output
    assert [item["key"] for item in json.loads(result.stdout)] == [key]
    assert "did not all import (ModuleNotFoundError" in result.stderr
