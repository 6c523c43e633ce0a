"""The producer and the worker compute the same key, whatever the serializer does to the arguments.

The worker only ever sees the arguments after the message's serializer
round trip (a tuple becomes a list under JSON, a NumPy-like float subclass
a plain float, a NaN mapping key the string "NaN"). The key the producer
computes (``lock_key_for``, and the enqueue lock) must equal the key the
worker's ``__call__`` computes from what it receives.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.serialization import dumps, loads

from celery_redislock import LockKeyError, SingletonTask
from tests.conftest import embedded_worker

pytestmark = pytest.mark.worker


class FloatLike(float):
    """A float subclass with its own repr, as NumPy's float64 has."""

    def __repr__(self) -> str:
        return f"np.float64({float.__repr__(self)})"


def received(serializer: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The arguments as a worker receives them (kombu, as Celery's Request decodes them)."""
    content_type, encoding, body = dumps((args, kwargs), serializer=serializer)
    decoded = loads(body, content_type, encoding, accept={content_type})
    return decoded[0], decoded[1]


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.text(max_size=6)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(allow_nan=True, allow_infinity=True).map(FloatLike)
)
mapping_keys = (
    st.text(max_size=4)
    | st.integers(-5, 5)
    | st.booleans()
    | st.none()
    | st.sampled_from([math.nan, math.inf, 1.5, FloatLike(2.5)])
)
trees = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(mapping_keys, children, max_size=3)
    ),
    max_leaves=8,
)


@pytest.mark.parametrize("serializer", ["json", "pickle"])
def test_producer_key_equals_the_worker_key_after_a_real_round_trip(
    app_factory: Any, lock_client: redis.Redis, serializer: str
) -> None:
    app: Celery = app_factory(
        task_serializer=serializer, accept_content=["json", "pickle"], result_serializer="json"
    )

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any, value: Any, other: Any = None) -> str:
        return str(self.lock.key)

    def worker_key(args: Any, kwargs: Any) -> str:
        # What the worker's __call__ computes from the decoded message.
        job.push_request(id="tid", retries=0, hostname="w@h", called_directly=False)
        try:
            return str(job(*args, **kwargs))
        finally:
            job.pop_request()

    @settings(
        max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(trees, trees)
    def check(value: Any, other: Any) -> None:
        try:
            producer = job.lock_key_for((value,), {"other": other})
        except LockKeyError:
            return  # refused at the producer: nothing is published, nothing can drift
        args, kwargs = received(serializer, [value], {"other": other})
        assert producer == worker_key(args, kwargs)

    check()


def test_nested_sets_too_deep_are_a_lock_key_error(app: Celery) -> None:
    @app.task(base=SingletonTask, shared=False, serializer="pickle")
    def job(value: Any) -> None: ...

    deep: Any = frozenset()
    for _ in range(2000):
        deep = frozenset([deep])
    # Refused with a LockKeyError that says why (pickle's own recursion
    # limit here; the key encoding's depth limit for values pickle accepts).
    with pytest.raises(LockKeyError, match=r"nested|recursion"):
        job.lock_key_for((deep,), {})
    shallow: Any = frozenset()
    for _ in range(100):
        shallow = frozenset([shallow])
    with pytest.raises(LockKeyError, match="nested more than 64 levels"):
        job.lock_key_for((shallow,), {})


def test_a_float_subclass_under_json_is_adopted_not_left_queued(
    app: Celery, lock_client: redis.Redis
) -> None:
    """With lock_enqueue a drifted key could not be adopted and blocked later calls."""

    @app.task(base=SingletonTask, shared=False, lock_enqueue=True)
    def job(amount: float, by_account: dict[Any, Any]) -> float:
        return amount

    args = (FloatLike(12.5), {math.nan: 1, 7: (1, 2)})
    with embedded_worker(app, "threads", 1):
        first = job.delay(*args)
        assert first.get(timeout=20) == 12.5
        assert lock_client.exists(job.lock_key_for(args, {})) == 0
        second = job.delay(*args)
        assert second.id != first.id  # not deduplicated against a finished task
        assert second.get(timeout=20) == 12.5
