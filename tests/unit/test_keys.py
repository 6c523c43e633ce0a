"""Key building: one key per logical call, type-tagged, stable across JSON."""

from __future__ import annotations

import datetime
import decimal
import inspect
import uuid
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.utils.json import dumps, loads

from celery_redislock import ConfigurationError, LockKeyError, SingletonTask
from celery_redislock.keys import (
    argument_digest,
    bind_lock_arguments,
    canonical_encoding,
    custom_key,
    plain_parameter_names,
    task_key,
)


def run(a: Any, b: Any = 2, *rest: Any, c: Any = None, **extra: Any) -> None:
    """A signature with every kind of parameter."""


SIG = inspect.signature(run)


def key(*args: Any, lock_args: tuple[str, ...] | None = None, **kwargs: Any) -> str:
    return task_key("p", "t", bind_lock_arguments(SIG, args, kwargs, lock_args, "t"))


def test_key_format_has_prefix_task_name_and_hash_tag() -> None:
    k = key(1)
    prefix, name, tag = k.split(":")
    assert (prefix, name) == ("p", "t")
    assert tag.startswith("{") and tag.endswith("}")
    assert len(tag) == 2 + 32  # 128-bit digest in hex


@pytest.mark.parametrize(
    ("task_name", "arguments", "digest"),
    [
        ("app.charge", {}, "410301a5cf5b2f38eb0042a2908a615d"),
        ("app.charge", {"order_id": 7, "amount": 12.5}, "ee3d639f82741d730c032e6a2245e1a9"),
        (
            "tasks.\u00fc",
            {"b": [1, "x", None, True], "a": {"k": (1, 2)}},
            "c98f66ca8d2541d21e09befd11981040",
        ),
    ],
)
def test_a_call_keeps_the_key_every_earlier_release_gave_it(
    task_name: str, arguments: dict[str, Any], digest: str
) -> None:
    # Workers of two releases share the keys during a rolling upgrade: any
    # change to these digests needs a new KEY_FORMAT_VERSION. Twice: the
    # second call of a task name takes the per-name shortcut.
    assert argument_digest(task_name, arguments) == digest
    assert argument_digest(task_name, arguments) == digest


def test_call_shapes_of_one_logical_call_share_a_key() -> None:
    assert key(1) == key(a=1) == key(1, 2) == key(1, b=2) == key(b=2, a=1) == key(1, c=None)


def test_keyword_order_never_matters() -> None:
    assert key(1, x=1, y=2) == key(1, y=2, x=1)
    assert key({"a": 1, "b": 2}) == key({"b": 2, "a": 1})


def plain_run(a: Any, b: Any, c: Any) -> None:
    """Positional-or-keyword parameters only, no defaults: bound without Signature.bind."""


PLAIN = inspect.signature(plain_run)


@pytest.mark.parametrize("lock_args", [None, ("b",), ("c", "a"), ()])
def test_positional_fast_path_binds_as_signature_bind(lock_args: tuple[str, ...] | None) -> None:
    names = plain_parameter_names(PLAIN)
    assert names == ("a", "b", "c")
    for args, kwargs in [((1, 2, 3), {}), ((1,), {"c": 3, "b": 2}), ((), {"a": 1, "b": 2, "c": 3})]:
        fast = bind_lock_arguments(PLAIN, args, kwargs, lock_args, "t", names)
        slow = bind_lock_arguments(PLAIN, args, kwargs, lock_args, "t")
        assert fast == slow
        assert list(fast) == list(slow)  # same order: the digest sorts, but be exact
        assert task_key("p", "t", fast) == task_key("p", "t", slow)


def test_positional_fast_path_still_refuses_a_call_that_does_not_fit() -> None:
    names = plain_parameter_names(PLAIN)
    with pytest.raises(LockKeyError, match="do not match"):
        bind_lock_arguments(PLAIN, (1, 2), {}, None, "t", names)
    with pytest.raises(LockKeyError, match="do not match"):
        bind_lock_arguments(PLAIN, (1, 2, 3, 4), {}, None, "t", names)


def test_signatures_with_defaults_or_variadics_have_no_fast_path() -> None:
    assert plain_parameter_names(SIG) is None
    assert plain_parameter_names(inspect.signature(lambda a, /, b: None)) is None
    assert plain_parameter_names(inspect.signature(lambda: None)) == ()


def test_different_calls_get_different_keys() -> None:
    assert key(1) != key(2)
    assert key(1) != key(1, 3)
    assert key(1, 2, 3) != key(1, 2)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (1, "1"),
        (None, "None"),
        (1, 1.0),
        (True, 1),
        (False, 0),
        ("", None),
        (b"ab", "ab"),
        ([1, 2], "[1, 2]"),
        ({"a": 1}, [["a", 1]]),
        (decimal.Decimal("1.1"), 1.1),
        ("a_b-2", "a_b-3"),
        ({"a": "1_b-2"}, {"a": "1", "b": "2"}),  # celery-once #19 collision
    ],
)
def test_type_tags_keep_lookalike_values_apart(left: Any, right: Any) -> None:
    assert key(left) != key(right)


def test_tuple_and_list_are_one_value_like_after_json() -> None:
    assert key((1, 2)) == key([1, 2])
    assert key({"x": (1, (2, 3))}) == key({"x": [1, [2, 3]]})


def test_int_dict_keys_are_keyed_as_the_worker_receives_them() -> None:
    assert key({1: "x"}) == key({"1": "x"})


def test_duplicate_json_object_keys_are_an_error() -> None:
    with pytest.raises(LockKeyError, match="both '1'"):
        key({1: "x", "1": "y"})


VALUES: list[Any] = [
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    datetime.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=datetime.timezone.utc),
    datetime.date(2026, 1, 2),
    datetime.time(3, 4, 5),
    decimal.Decimal("1.10"),
    b"\x00\xffbytes",
    (1, "two", [3.5, None, True]),
    {"nested": {"b": [1, {"c": (2,)}], "a": None}, 7: "int key"},
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_key_survives_the_kombu_json_round_trip(value: Any) -> None:
    """The producer's value and the worker's decoded value give one key."""
    received = loads(dumps(value))
    assert key(value) == key(received)


def test_uuid_and_its_string_differ() -> None:
    value = uuid.uuid4()
    assert key(value) != key(str(value))


def test_object_without_stable_encoding_is_a_clear_error() -> None:
    class Opaque:
        pass

    with pytest.raises(
        LockKeyError, match=r"t: argument 'a'\[0\] of type .*Opaque has no stable encoding"
    ):
        key([Opaque()])


def test_arguments_that_do_not_fit_the_signature_are_a_clear_error() -> None:
    with pytest.raises(LockKeyError, match="do not match run"):
        key()


def test_huge_arguments_give_a_fixed_size_key() -> None:
    assert len(key("x" * 5_000_000)) == len(key(1))


def test_lock_args_keep_only_the_named_arguments() -> None:
    assert key(1, 2, lock_args=("a",)) == key(1, 3, lock_args=("a",))
    assert key(1, lock_args=("a",)) != key(2, lock_args=("a",))
    assert key(1, lock_args=()) == key(99, lock_args=())


def test_sets_are_order_free() -> None:
    assert key({3, 1, 2}) == key({1, 2, 3})
    assert key(frozenset({"a"})) != key({"a": None})


def test_custom_key_uses_the_callable_and_a_hash_tag() -> None:
    assert custom_key("p", lambda a, kw: f"acct-{kw['id']}", (), {"id": 7}, "t") == "p:{acct-7}"
    with pytest.raises(LockKeyError, match="non-empty str"):
        custom_key("p", lambda a, kw: None, (), {}, "t")  # type: ignore[arg-type,return-value]


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.text(max_size=8)
        | st.floats(allow_nan=False),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=4), children, max_size=4)
        ),
        max_leaves=12,
    )
)
def test_json_round_trip_never_changes_the_key(value: Any) -> None:
    assert key(value) == key(loads(dumps(value)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(), st.text(max_size=6)), min_size=2, max_size=2, unique=True))
def test_distinct_scalars_give_distinct_encodings(pair: list[Any]) -> None:
    left, right = pair
    if type(left) is type(right):
        assert canonical_encoding(left) != canonical_encoding(right)
    assert key(left) != key(right)


def test_million_distinct_args_give_distinct_keys() -> None:
    keys = {task_key("p", "t", {"a": n}) for n in range(200_000)}
    assert len(keys) == 200_000


# -- validation when the task is registered --------------------------------------


def test_unknown_lock_args_fail_at_registration() -> None:
    app = Celery("keys-test", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"'acount_id'.*does not accept.*account_id"):

        @app.task(base=SingletonTask, lock_args=("acount_id",), shared=False)
        def sync(account_id: int) -> None: ...

        sync.name  # noqa: B018 (forces the lazy task to be created)


def test_lock_args_as_a_bare_string_is_rejected() -> None:
    app = Celery("keys-test", set_as_current=False)
    with pytest.raises(ConfigurationError, match=r"not the string 'x'"):

        @app.task(base=SingletonTask, lock_args="x", shared=False)
        def one(x: int) -> None: ...

        one.name  # noqa: B018


def test_bind_true_tasks_key_without_self() -> None:
    app = Celery("keys-test", set_as_current=False, set_as_default=False)
    app.conf.redislock_url = "redis://127.0.0.1:1/0"  # never contacted: keys need no I/O

    @app.task(base=SingletonTask, bind=True, lock_args=("account_id",), shared=False)
    def bound(self: Any, account_id: int, full: bool = False) -> None: ...

    @app.task(base=SingletonTask, shared=False)
    def plain(account_id: int, full: bool = False) -> None: ...

    assert bound.lock_key_for((5,), {}) == bound.lock_key_for((), {"account_id": 5, "full": True})
    assert plain.lock_key_for((5,), {}) == plain.lock_key_for((5, False), {})
    assert plain.lock_key_for((5,), {}) != plain.lock_key_for((5, True), {})


def test_key_uses_the_real_task_name_not_the_shadow() -> None:
    app = Celery("keys-test", set_as_current=False, set_as_default=False)
    app.conf.redislock_url = "redis://127.0.0.1:1/0"

    @app.task(base=SingletonTask, name="billing.sync", shared=False)
    def sync(x: int) -> None: ...

    assert sync.lock_key_for((1,), {}).startswith("redislock:billing.sync:{")
