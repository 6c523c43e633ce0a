"""The lock value format: ownership prefixes and fresh nonces."""

from __future__ import annotations

import os
import pickle

from celery_redislock import LockContended, LockLost, LockNotOwned
from celery_redislock.tokens import LockOwner, LockValue, new_nonce


def test_value_round_trips_with_awkward_text() -> None:
    owner = LockOwner("id|with|pipes%", 3, "celery@host|x", 4242)
    value = LockValue.new(owner, "tasks.sync|x")
    decoded = LockValue.decode(value.encode())
    assert decoded == value


def test_value_starts_with_its_owner_prefix() -> None:
    owner = LockOwner("abc", 0, "celery@h", 10)
    assert LockValue.new(owner, "t").encode().startswith(owner.prefix())


def test_other_attempts_pids_hosts_and_tasks_never_share_a_prefix() -> None:
    value = LockValue.new(LockOwner("abc", 10, "celery@h", 123), "t").encode()
    for other in [
        LockOwner("abc", 1, "celery@h", 123),  # attempt 1 is a text prefix of attempt 10
        LockOwner("abc", 10, "celery@h", 12),  # pid 12 is a text prefix of 123
        LockOwner("ab", 10, "celery@h", 123),
        LockOwner("abc", 10, "celery@", 123),
        LockOwner("abc", 10, "celery@h2", 123),
    ]:
        assert not value.startswith(other.prefix()), other


def test_prefix_without_pid_matches_only_that_attempt_on_that_node() -> None:
    value = LockValue.new(LockOwner("abc", 2, "celery@h", 99), "t").encode()
    assert value.startswith(LockOwner("abc", 2, "celery@h", None).prefix())
    assert not value.startswith(LockOwner("abc", 3, "celery@h", None).prefix())


def test_current_owner_uses_this_process() -> None:
    owner = LockOwner.current("id", 1, None)
    assert owner.pid == os.getpid() and owner.hostname


def test_foreign_values_decode_to_none() -> None:
    assert LockValue.decode("some-other-library-token") is None
    assert LockValue.decode(b"v1|a|notanint|h|1|n|t|0") is None


def test_nonces_are_unique_and_128_bit() -> None:
    nonces = {new_nonce() for _ in range(100_000)}
    assert len(nonces) == 100_000
    assert all(len(n) == 32 for n in list(nonces)[:10])


def test_exceptions_survive_pickle_with_their_fields() -> None:
    error = pickle.loads(pickle.dumps(LockContended("k", "holder-id", 1.5)))
    assert (error.key, error.holder_task_id, error.ttl_remaining) == ("k", "holder-id", 1.5)
    assert "holder-id" in str(error)
    lost = pickle.loads(pickle.dumps(LockLost("k", "gone")))
    assert isinstance(lost, LockNotOwned) and lost.detail == "gone"
    # The threads pool's abort: Python raises the bare class (no key to name).
    assert str(LockLost()) == "the lock was lost while held; execution aborted"


def test_a_value_without_pid_round_trips_and_matches_its_prefix() -> None:
    owner = LockOwner("queued-id", 0, "<queued>", None)
    value = LockValue.new(owner, "t")
    assert LockValue.decode(value.encode()) == value
    assert value.encode().startswith(owner.prefix())


def test_nonces_are_unique_across_draws_and_never_repeat_in_a_forked_child() -> None:
    """Nonces are drawn 64 at a time: a child must not hand out its parent's next ones."""
    parent = {new_nonce() for _ in range(200)}  # several draws
    assert len(parent) == 200 and all(len(n) == 32 for n in parent)
    int(next(iter(parent)), 16)  # hex
    new_nonce()  # leave a partly used draw behind for the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its pid as the package sees it and its next nonces
        from celery_redislock._process import current_pid

        os.write(write_end, f"{current_pid()} {os.getpid()} {new_nonce()} {new_nonce()}".encode())
        os._exit(0)
    os.close(write_end)
    seen_pid, real_pid, *child_nonces = os.read(read_end, 4096).decode().split()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert seen_pid == real_pid == str(pid)
    parent_next = [new_nonce() for _ in range(2)]
    assert set(child_nonces).isdisjoint(parent_next)
    assert set(child_nonces).isdisjoint(parent)


def test_current_pid_is_os_getpid() -> None:
    from celery_redislock._process import current_pid

    assert current_pid() == os.getpid()
