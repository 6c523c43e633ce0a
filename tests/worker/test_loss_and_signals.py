"""What a running task sees when its lock is lost, and the signals it sends."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import SingletonTask, lock_acquired, lock_lost, lock_released, lock_renewed
from tests.conftest import embedded_worker
from tests.servers import wait_until

pytestmark = pytest.mark.worker


@pytest.fixture
def signals_seen() -> Any:
    seen: list[tuple[str, dict[str, Any]]] = []
    receivers = []
    for signal in (lock_acquired, lock_renewed, lock_lost, lock_released):

        def receiver(sender: Any = None, _name: str = signal.name, **kwargs: Any) -> None:
            if kwargs.get("task_id"):  # not a standalone lock another test dropped
                seen.append((_name, kwargs))

        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    yield seen
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def test_stolen_lock_is_visible_to_the_task_and_release_leaves_the_thief_alone(
    app: Celery,
    record: redis.Redis,
    lock_client: redis.Redis,
    signals_seen: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=0.6)
    def job(self: Any) -> bool:
        record.set("key", self.lock.key)
        wait_until(lambda: self.lock.lost, timeout=10, message="the task to see the loss")
        return bool(self.lock.lost and not self.lock.owned)

    with caplog.at_level("WARNING", logger="celery_redislock"), embedded_worker(app, "threads", 2):
        result = job.delay()
        key = wait_until(lambda: record.get("key"), timeout=20)
        lock_client.set(key, "v1|thief|0|h|1|n|t|0", px=60000)
        assert result.get(timeout=20) is True  # release never raised into the task
    assert lock_client.get(key) == b"v1|thief|0|h|1|n|t|0"
    assert "was lost (stolen)" in caplog.text
    assert "no longer ours at release" in caplog.text
    names = [name for name, _ in signals_seen]
    assert names.count("lock_lost") == 1
    lost = next(kw for name, kw in signals_seen if name == "lock_lost")
    assert (lost["key"], lost["task_name"], lost["task_id"], lost["reason"]) == (
        key,
        job.name,
        result.id,
        "stolen",
    )
    released = next(kw for name, kw in signals_seen if name == "lock_released")
    assert released["outcome"] == "not_ours" and released["held"] > 0


def test_signals_carry_key_task_and_timing(
    app: Celery, record: redis.Redis, signals_seen: Any
) -> None:
    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=0.3)
    def job(self: Any) -> None:
        wait_until(lambda: self.lock.renewals >= 2, timeout=10, message="two renewals")

    with embedded_worker(app, "solo"):
        result = job.delay()
        result.get(timeout=20)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for name, kwargs in signals_seen:
        by_name.setdefault(name, []).append(kwargs)
    assert len(by_name["lock_acquired"]) == 1 and len(by_name["lock_released"]) == 1
    assert len(by_name["lock_renewed"]) >= 2
    for kwargs in (by_name["lock_acquired"][0], by_name["lock_released"][0]):
        assert kwargs["task_id"] == result.id and kwargs["task_name"] == job.name
        assert kwargs["key"].startswith(f"redislock:{job.name}:{{")
    assert by_name["lock_acquired"][0]["waited"] >= 0
    assert by_name["lock_released"][0]["outcome"] == "released"
    assert by_name["lock_released"][0]["held"] >= by_name["lock_renewed"][-1]["held"]
    assert "lock_lost" not in by_name


@pytest.mark.parametrize(("taken_by", "reason"), [("thief", "stolen"), (None, "gone")])
def test_a_loss_the_release_finds_first_is_reported_as_lost(
    app: Celery,
    record: redis.Redis,
    lock_client: redis.Redis,
    signals_seen: Any,
    taken_by: str | None,
    reason: str,
) -> None:
    class Hooked(SingletonTask):  # type: ignore[misc]
        def on_lock_lost(self, handle: Any) -> None:
            record.set("hook", handle.lost_reason or "")

    # A TTL of 30 s renews every 10 s: the release, not the renewer, finds the loss.
    @app.task(base=Hooked, bind=True, shared=False, lock_ttl=30, name="hooked")
    def hooked(self: Any) -> None:
        record.set("key", self.lock.key)
        wait_until(lambda: record.get("taken"), timeout=10, message="the key taken")

    with embedded_worker(app, "threads", 2):
        result = hooked.delay()
        key = wait_until(lambda: record.get("key"), timeout=20)
        if taken_by:
            lock_client.set(key, f"v1|{taken_by}|0|h|1|n|t|0", px=60000)
        else:
            lock_client.delete(key)
        record.set("taken", 1)
        result.get(timeout=20)
    # Another test's lock dropped unreleased may report its own loss meanwhile.
    lost = [kw for name, kw in signals_seen if name == "lock_lost" and kw["key"] == key]
    assert [(kw["task_id"], kw["reason"]) for kw in lost] == [(result.id, reason)]
    assert record.get("hook") == reason
    released = next(kw for name, kw in signals_seen if name == "lock_released" and kw["key"] == key)
    assert released["outcome"] == ("not_ours" if taken_by else "already_gone")
