"""A lock key's family: one object per execution names every companion key once."""

from __future__ import annotations

import json
import pickle

import pytest

from celery_redislock.key_family import (
    KeyFamily,
    debounce_key,
    family_of,
    fence_key,
    handoff_keys,
    next_run_key,
    queued_key,
    release_channel,
    slot_key,
    slot_keys,
)
from celery_redislock.keys import custom_key, task_key

KEYS = [
    "redislock:tasks.charge:{0f1e}",  # a task key: its hash tag is kept
    "reports:daily",  # a standalone name: it becomes the tag
    "redislock:tasks.charge:{0f1e}:slot:3",  # a slot: its base key's companions
]


@pytest.mark.parametrize("key", KEYS)
def test_a_family_names_each_companion_as_the_naming_functions_do(key: str) -> None:
    family = KeyFamily(key)
    assert family == key and hash(family) == hash(key) and {key: 1}[family] == 1
    assert family.fence == fence_key(key)
    assert family.handoff == handoff_keys(key)
    assert family.queued == queued_key(key)
    assert family.next_run == next_run_key(key)
    assert family.debounce == debounce_key(key)
    assert family.channel == release_channel(key)
    if key.endswith("}"):
        assert family.slots(3) == slot_keys(key, 3) == [key, slot_key(key, 2), slot_key(key, 3)]


def test_a_family_is_built_once_and_handed_down() -> None:
    family = task_key("redislock", "tasks.charge", {"account": 7})
    assert type(family) is KeyFamily
    assert family_of(family) is family  # what the stores call: nothing new is built
    assert family.fence is family.fence  # named once
    plain = str(family)
    assert type(family_of(plain)) is KeyFamily and family_of(plain) == family
    custom = custom_key("redislock", lambda args, kwargs: "account:7", (), {}, "tasks.charge")
    assert type(custom) is KeyFamily and custom == "redislock:{account:7}"


def test_a_family_travels_as_the_plain_key() -> None:
    family = task_key("redislock", "tasks.charge", {"account": 7})
    assert family.fence  # named before it travels
    assert json.loads(json.dumps({"key": family})) == {"key": str(family)}
    copy = pickle.loads(pickle.dumps(family))
    assert copy == family and copy.fence == family.fence
    assert f"{family}" == str(family) and type(str(family)) is str
    assert repr(family) == repr(str(family))
