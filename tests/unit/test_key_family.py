"""A lock key's family: one object per execution names every companion key once."""

from __future__ import annotations

import enum
import json
import os
import pickle
import signal
import threading

import pytest
import yaml
from redis.crc import key_slot

from celery_redislock.exceptions import LockContended
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
from celery_redislock.policies import skipped_result
from tests.servers import wait_until

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
    assert f"{family}" == str(family) and type(str(family)) is str
    assert repr(family) == repr(str(family))


def test_a_fork_while_another_thread_names_companions_never_stalls_the_child() -> None:
    # The renewer thread names fence keys while a prefork worker forks its
    # children: a lock taken while naming, and held at the fork, would be
    # held in the child for ever.
    stop = threading.Event()

    def name_companions() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            family = KeyFamily(f"redislock:tasks.charge:{{{n}}}")
            family.fence, family.handoff, family.channel  # noqa: B018 - naming is the work

    namer = threading.Thread(target=name_companions, daemon=True)
    namer.start()
    try:
        for _ in range(40):
            pid = os.fork()
            if pid == 0:  # the child names one companion, then exits at once
                os._exit(0 if KeyFamily("a:{b}").fence == "a:{b}:fence" else 1)
            status: list[int] = []

            def reaped(child: int = pid, status: list[int] = status) -> bool:
                done, code = os.waitpid(child, os.WNOHANG)
                status.append(code)
                return done != 0

            try:
                wait_until(reaped, interval=0.001, message="the child forked while naming to exit")
            except AssertionError:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise
            assert os.waitstatus_to_exitcode(status[-1]) == 0
    finally:
        stop.set()
        namer.join()


def test_a_key_leaves_the_process_as_a_plain_str() -> None:
    # A result or exception is serialized: kombu's yaml refuses str
    # subclasses, and a process without KeyFamily (an older version) must
    # read a pickled one (review helper-41 F1).
    family = task_key("redislock", "tasks.charge", {"account": 7})
    assert family.fence  # named, so its __dict__ is not empty
    skipped = skipped_result(family, "tasks.charge", None)
    contended = LockContended(family, "other", 1.0)
    assert type(skipped["key"]) is str and type(contended.key) is str
    assert yaml.safe_load(yaml.safe_dump(skipped))["key"] == family
    # self.lock.key and the signals' key are the family: a user may send it.
    assert yaml.safe_load(yaml.safe_dump({"key": family})) == {"key": str(family)}
    copy = pickle.loads(pickle.dumps(family))
    assert type(copy) is str and copy == family
    assert b"KeyFamily" not in pickle.dumps({"key": family})
    assert type(pickle.loads(pickle.dumps(contended)).key) is str


class _Locks(str, enum.Enum):
    REPORT = "nightly-report"


def test_a_key_of_another_str_subclass_names_its_family_by_its_value() -> None:
    # What Redis is sent as the key is its value (str.encode), not its str()
    # (review helper-41 F3): the companions are named from the same text.
    family = family_of(_Locks.REPORT)
    assert family == "nightly-report" and type(family) is KeyFamily
    assert family.fence == fence_key("nightly-report")


#: Keys Redis Cluster hashes whole although they hold braces: no hash tag
#: (an empty one, a "}" before any "{"), so "{key}" would not be their slot.
UNTAGGED_WITH_BRACES = ["a}b", "{}", "x{}y{z}", "a}:slot:2", "}{", "{}}"]


@pytest.mark.parametrize("key", [*UNTAGGED_WITH_BRACES, *KEYS, "{tag}x", "plain:name"])
def test_every_companion_is_in_the_lock_keys_cluster_slot(key: str) -> None:
    family = KeyFamily(key)
    base = key.rsplit(":slot:", 1)[0] if key.startswith("redislock:") else key
    companions = [
        family.fence,
        *family.handoff,
        family.queued,
        family.next_run,
        family.debounce,
    ]
    assert {key_slot(name.encode()) for name in companions} == {key_slot(base.encode())}
    assert len(set(companions)) == len(companions)


def test_keys_without_braces_or_with_a_hash_tag_keep_their_companion_names() -> None:
    # A rolling upgrade shares these names with the versions before.
    assert fence_key("reports:daily") == "{reports:daily}:fence"
    assert fence_key("redislock:t:{0f1e}") == "redislock:t:{0f1e}:fence"
    assert handoff_keys("{tag}x")[0] == "{tag}x:waiters"


def test_untagged_keys_with_braces_get_companions_of_their_own() -> None:
    fences = {fence_key(key) for key in UNTAGGED_WITH_BRACES}
    assert len(fences) == len(UNTAGGED_WITH_BRACES)
    assert all(key in fence_key(key) for key in UNTAGGED_WITH_BRACES)  # readable in a listing
