"""The shared renewer: one thread, one round trip per tick, loss reported once."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import redis

from celery_redislock import RedisLock, lock_lost
from celery_redislock.renewer import renewer
from tests.helpers import held_locks
from tests.servers import RedisServer, wait_until


def os_thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def lost_events() -> Any:
    events: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        events.append(kwargs)

    lock_lost.connect(receiver, weak=False)
    yield events
    lock_lost.disconnect(receiver)


def test_many_locks_share_one_thread_and_one_round_trip_per_tick(lock_client: redis.Redis) -> None:
    locks = [RedisLock(lock_client, f"many:{i}", ttl=0.6) for i in range(300)]
    locks[0].acquire()
    threads_with_one = os_thread_count()
    for lock in locks[1:]:
        assert lock.acquire(blocking=False)
    assert os_thread_count() == threads_with_one  # no thread per lock
    trips_before = renewer().round_trips
    handles = [lock.handle for lock in locks]
    # Hold for 4 TTLs; every key must stay alive throughout.
    for _ in range(24):
        pipe = lock_client.pipeline(transaction=False)
        for lock in locks:
            pipe.pttl(lock.name)
        assert min(pipe.execute()) > 0
        threading.Event().wait(0.1)
    renewals = [h.renewals for h in handles if h is not None]
    trips = renewer().round_trips - trips_before
    assert min(renewals) >= 6  # renewed every TTL/3 = 0.2 s
    assert trips <= max(renewals) + 2  # all 300 locks per round trip, not one each
    for lock in locks:
        lock.release()
    assert held_locks(lock_client) == []


def test_short_holds_cause_no_renewal_traffic(lock_client: redis.Redis) -> None:
    trips_before = renewer().round_trips
    for i in range(50):
        with RedisLock(lock_client, f"short:{i}", ttl=30):
            pass
    assert renewer().round_trips == trips_before


def test_deleted_lock_is_reported_lost_once_and_others_keep_renewing(
    lock_client: redis.Redis, lost_events: list[dict[str, Any]]
) -> None:
    victim = RedisLock(lock_client, "victim", ttl=0.6)
    survivor = RedisLock(lock_client, "survivor", ttl=0.6)
    victim.acquire()
    survivor.acquire()
    lock_client.delete("victim")
    wait_until(lambda: victim.lost, timeout=3, message="loss to be detected")
    assert victim.handle is not None and victim.handle.lost_reason == "gone"
    assert not victim.owned
    base = survivor.handle.renewals if survivor.handle else 0
    wait_until(
        lambda: survivor.handle is not None and survivor.handle.renewals >= base + 3, timeout=5
    )
    mine = [e for e in lost_events if e["key"] in ("victim", "survivor")]
    assert [(e["key"], e["reason"]) for e in mine] == [("victim", "gone")]
    assert lock_client.exists("victim") == 0  # never re-created
    survivor.release()
    victim.release()


def test_taken_over_lock_is_reported_stolen_and_left_alone(
    lock_client: redis.Redis, lost_events: list[dict[str, Any]]
) -> None:
    lock = RedisLock(lock_client, "stolen", ttl=0.6)
    lock.acquire()
    lock_client.set("stolen", "someone-else", px=60000)
    wait_until(lambda: lock.lost, timeout=3)
    assert lock.handle is not None and lock.handle.lost_reason == "stolen"
    lock.release()
    assert lock_client.get("stolen") == b"someone-else"
    assert [e["reason"] for e in lost_events if e["key"] == "stolen"] == ["stolen"]


def test_callback_fires_once_from_the_renewer(lock_client: redis.Redis) -> None:
    calls: list[str] = []
    lock = RedisLock(lock_client, "cb", ttl=0.6)
    lock.acquire()
    assert lock.handle is not None
    lock.handle.on_lost(lambda handle: calls.append(threading.current_thread().name))
    lock.handle.on_lost(lambda handle: 1 / 0)  # a failing callback is logged, not fatal
    lock_client.delete("cb")
    wait_until(lambda: calls, timeout=3)
    threading.Event().wait(0.5)
    assert len(calls) == 1


def test_release_stops_renewal_and_nothing_resurrects_the_key(lock_client: redis.Redis) -> None:
    lock = RedisLock(lock_client, "released", ttl=0.3)
    lock.acquire()
    wait_until(lambda: lock.handle is not None and lock.handle.renewals >= 1, timeout=3)
    lock.release()
    threading.Event().wait(0.5)  # 5 renewal periods
    assert lock_client.exists("released") == 0


def test_renewer_survives_a_redis_restart(
    redis_server_factory: Any, lost_events: list[dict[str, Any]]
) -> None:
    server: RedisServer = redis_server_factory()
    client = server.client()
    lock = RedisLock(client, "restart", ttl=0.9)
    lock.acquire()
    server.restart()  # comes back empty
    wait_until(lambda: lock.lost, timeout=5, message="loss after restart")
    assert lock.handle is not None and lock.handle.lost_reason in {"gone", "expired_locally"}
    assert renewer().alive
    again = RedisLock(client, "restart", ttl=0.6)
    assert again.acquire(blocking=False)
    wait_until(lambda: again.handle is not None and again.handle.renewals >= 2, timeout=5)
    again.release()
    lock.release()


def test_forked_child_never_renews_or_releases_the_parents_lock(lock_client: redis.Redis) -> None:
    lock = RedisLock(lock_client, "parent", ttl=0.6)
    lock.acquire()
    value = lock_client.get("parent")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            held_in_child = renewer().held
            assert lock.handle is not None
            lock.handle.release()  # must be refused: another pid
            own = RedisLock(lock_client, "child", ttl=0.6)
            own.acquire()
            wait_until(lambda: own.handle is not None and own.handle.renewals >= 2, timeout=5)
            own.release()
            os.write(write_fd, f"{held_in_child}".encode())
        except BaseException as exc:
            os.write(write_fd, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    _, status = os.waitpid(pid, 0)
    report = os.read(read_fd, 100).decode()
    os.close(read_fd)
    assert status == 0 and report == "0"
    assert lock_client.get("parent") == value  # the child's release was a no-op
    base = lock.handle.renewals if lock.handle else 0
    wait_until(lambda: lock.handle is not None and lock.handle.renewals >= base + 2, timeout=5)
    lock.release()


def test_renewer_survives_an_unexpected_error_in_a_tick(lock_client: redis.Redis) -> None:
    """A bug or a closed client in one backend must not stop every renewal."""
    from celery_redislock._clock import clock
    from celery_redislock.lease import LockHandle
    from celery_redislock.store import LockStore

    class Broken(LockStore):
        def warm_up(self) -> None:
            raise ValueError("I/O operation on closed file")

        def renew_many(self, items: Any, client: Any = None) -> Any:
            raise RuntimeError("boom")

    broken = LockHandle(
        Broken(client=lock_client),
        "broken",
        "v",
        0.3,
        clock(),
        task_name="broken",
        task_id=None,
        sender=None,
    )
    healthy = RedisLock(lock_client, "healthy", ttl=0.6)
    assert healthy.acquire(blocking=False)
    wait_until(lambda: healthy.handle is not None and healthy.handle.renewals >= 3, timeout=5)
    assert renewer().alive
    broken.release()
    healthy.release()


def test_a_release_sent_again_after_an_interruption_reports_released(
    lock_client: redis.Redis,
) -> None:
    """The first release reached Redis, then an exception cut its reply off."""
    from celery_redislock import lock_released
    from celery_redislock.lease import release_completely
    from celery_redislock.store import LockStore

    class InterruptedOnce(LockStore):
        interrupted = False

        def release(self, *args: Any, **kwargs: Any) -> Any:
            outcome = super().release(*args, **kwargs)  # Redis released it...
            if not self.interrupted:
                self.interrupted = True
                raise KeyboardInterrupt  # ...and the caller never saw the reply
            return outcome

    outcomes: list[str] = []
    lock_released.connect(lambda sender=None, **kw: outcomes.append(kw["outcome"]), weak=False)
    lock = RedisLock(lock_client, "interrupted-release", ttl=5)
    assert lock.acquire(blocking=False)
    assert lock.handle is not None
    lock.handle.backend = InterruptedOnce(client=lock_client)
    with pytest.raises(KeyboardInterrupt):
        release_completely(lock.handle.release)
    assert outcomes[-1:] == ["released"]
    assert lock_client.exists("interrupted-release") == 0


_FRESH_PROCESS_INTERRUPT = """
import sys, time
import redis
import celery_redislock.renewer as renewer_module
from celery_redislock import RedisLock
from celery_redislock.renewer import renewer
from celery_redislock.store import LockStore
from celery_redislock.takeback import take_back_value
from tests.servers import wait_until

caller, callee = sys.argv[2], sys.argv[3]

def tracer(frame, event, arg):
    # A signal is handled at a call's first instruction: there, once.
    back = frame.f_back
    here = event == "call" and frame.f_code.co_name == callee
    if here and back and back.f_code.co_name == caller:
        sys.settrace(None)
        raise KeyboardInterrupt
    return tracer if event == "call" else None

if callee == "start_new_thread":  # a signal just after the thread started
    native = renewer_module._native

    def interrupted_start(module, name):
        start = native(module, name)
        if name != "start_new_thread":
            return start

        def start_then_interrupt(*args):
            start(*args)
            renewer_module._native = native
            raise KeyboardInterrupt

        return start_then_interrupt

    renewer_module._native = interrupted_start

client = redis.Redis(port=int(sys.argv[1]))
store = LockStore.for_client(client)
interrupted = False
sys.settrace(tracer)
try:
    if caller == "_ensure_running":  # the process's first renewed lock
        RedisLock(client, "first", ttl=1).acquire()
    else:  # the process's first take-back
        client.set("taken-back", "lost-reply-value")
        take_back_value(store, "taken-back", "lost-reply-value", now=False)
except KeyboardInterrupt:
    interrupted = True
finally:
    sys.settrace(None)
assert interrupted, "the interrupt never landed"
if caller == "_ensure_running":
    assert not client.exists("first")
    later = RedisLock(client, "later", ttl=60)  # starts the thread again if needed
    assert later.acquire()
    # A renewer thread (else locks expire unrenewed):
    wait_until(lambda: renewer().heartbeat is not None, message="a renewer thread")
    # A lock due before the thread's next wake-up wakes it (the current
    # thread: not one a later start superseded), and is renewed past its TTL.
    short = RedisLock(client, "short", ttl=1)
    assert short.acquire()
    # Renewed past its TTL (every 1/3 s: eight renewals take it 2.7 s on).
    handle = short.handle
    assert handle is not None
    wait_until(lambda: handle.renewals >= 8 or handle.lost, timeout=10, message="renewals")
    assert client.exists("short") and not short.lost, "expired unrenewed"
    short.release()
    later.release()
else:
    # The next take-back runs: this one's, and the interrupted one too.
    client.set("taken-back-next", "another-value")
    take_back_value(store, "taken-back-next", "another-value", now=False)
    # A take-back thread (else values stay for their TTL):
    gone = lambda: not client.exists("taken-back", "taken-back-next")  # noqa: E731
    wait_until(gone, message="both values taken back")
print("ok")
"""


@pytest.mark.parametrize(
    ("caller", "callee"),
    [
        ("_ensure_running", "_native"),  # before the thread starts
        ("_ensure_running", "start_new_thread"),  # after it started (simulated)
        ("add", "notify"),  # the take-back queued, the thread not yet started
        ("add", "__init__"),  # the take-back thread's construction
    ],
)
def test_an_interrupt_while_a_background_thread_starts_leaves_it_working(
    server: RedisServer, caller: str, callee: str
) -> None:
    # The renewer's and the take-backs' threads start on first use, in the
    # caller's thread: a signal there (Ctrl-C, a soft time limit) must not
    # leave the process believing a thread runs that never started (review
    # helper-40 F1, F2). A fresh process: this one's threads run already.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_INTERRUPT, str(server.port), caller, callee],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
