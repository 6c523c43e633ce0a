"""Reading the lock's message headers back: only a task's own values, ETAs as Celery reads them."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest

from celery_redislock import LockKeyError
from celery_redislock.headers import (
    QUEUED_TOKEN_HEADER,
    REDELIVERED_HEADER,
    as_received,
    own_values,
    queued_token,
    redelivered,
    seconds_until,
)
from celery_redislock.tokens import LockValue


def request(task_id: str, headers: dict[str, object] | None = None, **delivery: object) -> object:
    return SimpleNamespace(id=task_id, headers=headers or {}, delivery_info=delivery)


def test_a_header_can_only_name_values_of_its_own_task() -> None:
    mine = LockValue.queued("t1", "job").encode()
    theirs = LockValue.queued("t2", "job").encode()
    assert own_values(request("t1"), [mine, theirs, "garbage", 7]) == [mine]
    assert own_values(request("t1"), mine) == []  # not a list: ignored, never iterated
    assert queued_token(request("t1", {QUEUED_TOKEN_HEADER: theirs})) is None
    assert queued_token(request("t1", {QUEUED_TOKEN_HEADER: mine})) == mine


def test_a_redelivered_copy_stays_one_through_its_re_sends() -> None:
    assert not redelivered(request("t1"))
    assert redelivered(request("t1", redelivered=True))
    assert redelivered(request("t1", {REDELIVERED_HEADER: True}))


def test_seconds_until_reads_countdowns_and_etas_as_celery_does() -> None:
    assert seconds_until(None) == 0.0
    assert seconds_until(-3) == 0.0
    assert seconds_until(2.5) == 2.5
    eta = datetime.now(timezone.utc) + timedelta(seconds=60)
    assert 58 < seconds_until(eta) <= 60
    assert 58 < seconds_until(eta.isoformat()) <= 60
    naive_utc = eta.replace(tzinfo=None)  # a naive ETA is UTC
    assert 58 < seconds_until(naive_utc) <= 60
    assert seconds_until(datetime.now(timezone.utc) - timedelta(seconds=5)) == 0.0


def test_arguments_are_keyed_as_the_worker_receives_them() -> None:
    assert as_received((1, (2, 3)), {"k": (4,)}, "json", "job") == ((1, [2, 3]), {"k": [4]})
    assert as_received(((2, 3),), {}, "pickle", "job") == (((2, 3),), {})
    with pytest.raises(LockKeyError, match="job: the arguments cannot be sent with the 'json'"):
        as_received(({1, 2},), {}, "json", "job")


@pytest.mark.parametrize(
    ("expires", "moved"),
    [
        (2, 7),
        (2.5, 7.5),
        (
            datetime(2030, 1, 1, tzinfo=timezone.utc),
            datetime(2030, 1, 1, 0, 0, 5, tzinfo=timezone.utc),
        ),
        # As Celery parses ISO 8601 (dateutil), on Python 3.10 too, where
        # datetime.fromisoformat refuses "Z" and "+0000" (review helper-30).
        ("2030-01-01T00:00:00Z", datetime(2030, 1, 1, 0, 0, 5, tzinfo=timezone.utc)),
        ("2030-01-01T00:00:00+0000", datetime(2030, 1, 1, 0, 0, 5, tzinfo=timezone.utc)),
        ("20300101T000000Z", datetime(2030, 1, 1, 0, 0, 5, tzinfo=timezone.utc)),
        ("2029-12-31T24:00:00Z", datetime(2030, 1, 1, 0, 0, 5, tzinfo=timezone.utc)),
        (None, None),
    ],
)
def test_a_debounced_runs_expiry_moves_in_every_form_celery_takes(expires: Any, moved: Any) -> None:
    from celery_redislock.resend import moved_expiry

    assert moved_expiry(expires, 5) == moved
    assert moved_expiry(expires, 0) == expires
