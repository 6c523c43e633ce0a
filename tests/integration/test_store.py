"""Lock scripts against a real redis-server: ownership, idempotence, NOSCRIPT."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis

from celery_redislock import LockBackendError, RedisLock, ReleaseOutcome, SingletonTask
from celery_redislock.key_family import KeyFamily
from celery_redislock.settings import app_settings
from celery_redislock.store import RENEW_CHUNK_SIZE, LockStore, RenewOutcome
from tests.conftest import LOCK_DB
from tests.servers import RedisServer, wait_until


@pytest.fixture(params=[False, True], ids=["bytes", "decoded"])
def backend(request: pytest.FixtureRequest, server: RedisServer) -> LockStore:
    return LockStore(server.url_for(LOCK_DB), {"decode_responses": request.param})


def test_acquire_returns_holder_and_remaining_ttl_on_contention(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    assert backend.acquire("k", "v1|holder-id|0|h|1|n|t|0", 5000).acquired
    result = backend.acquire("k", "mine", 5000)
    assert not result.acquired
    assert result.holder_task_id == "holder-id"
    assert result.ttl_remaining is not None and 4.0 < result.ttl_remaining <= 5.0
    assert lock_client.get("k") == b"v1|holder-id|0|h|1|n|t|0"


def test_acquire_is_idempotent_for_our_own_value(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    """A client retry after a lost reply finds its own value: success, TTL refreshed."""
    assert backend.acquire("k", "mine", 1000).acquired
    assert backend.acquire("k", "mine", 60000).acquired
    assert lock_client.pttl("k") > 50000


def test_release_outcomes(backend: LockStore, lock_client: redis.Redis) -> None:
    backend.acquire("k", "mine", 5000)
    assert backend.release("k", "someone-else") is ReleaseOutcome.NOT_OURS
    assert lock_client.get("k") == b"mine"
    assert backend.release("k", "mine") is ReleaseOutcome.RELEASED
    assert backend.release("k", "mine") is ReleaseOutcome.ALREADY_GONE
    assert lock_client.exists("k") == 0


def test_prefix_release_only_matches_the_owner_prefix(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    backend.acquire("k", "v1|id|10|h|5|nonce|t|0", 5000)
    assert backend.release_owner("k", "v1|id|1|h|5|") is ReleaseOutcome.NOT_OURS
    assert backend.release_owner("k", "v1|id|10|h|5|") is ReleaseOutcome.RELEASED


def test_expiry_race_first_holder_cannot_delete_second_holders_lock(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    assert backend.acquire("k", "first", 100).acquired
    wait_until(lambda: lock_client.exists("k") == 0, message="first lock to expire")
    assert backend.acquire("k", "second", 5000).acquired
    assert backend.release("k", "first") is ReleaseOutcome.NOT_OURS
    assert backend.extend("k", "first", 5000) is RenewOutcome.STOLEN
    assert lock_client.get("k") == b"second"


def test_renew_never_recreates_an_expired_key(backend: LockStore, lock_client: redis.Redis) -> None:
    backend.acquire("k", "mine", 50)
    wait_until(lambda: lock_client.exists("k") == 0)
    assert backend.renew_many([("k", "mine", 5000)]) == [RenewOutcome.GONE]
    assert lock_client.exists("k") == 0


def test_scripts_survive_script_flush(backend: LockStore, lock_client: redis.Redis) -> None:
    backend.acquire("k", "mine", 5000)
    lock_client.script_flush()
    assert backend.renew_many([("k", "mine", 5000)]) == [RenewOutcome.RENEWED]
    lock_client.script_flush()
    assert backend.release("k", "mine") is ReleaseOutcome.RELEASED
    lock_client.script_flush()
    assert backend.acquire("k", "mine", 5000).acquired


def test_renew_many_in_one_pipeline_across_chunks(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    count = RENEW_CHUNK_SIZE * 2 + 7
    items = [(f"k{i}", f"v{i}", 1000) for i in range(count)]
    for key, value, ttl in items:
        backend.acquire(key, value, ttl)
    lock_client.set("k3", "stolen")
    lock_client.delete("k4")
    lock_client.script_flush()  # NOSCRIPT inside the pipeline is re-sent as EVAL
    outcomes = backend.renew_many([(k, v, 60000) for k, v, _ in items])
    assert outcomes[3] is RenewOutcome.STOLEN
    assert outcomes[4] is RenewOutcome.GONE
    assert outcomes.count(RenewOutcome.RENEWED) == count - 2
    assert lock_client.pttl(f"k{count - 1}") > 50000


def test_unreachable_redis_is_a_lock_backend_error(redis_server_factory) -> None:  # type: ignore[no-untyped-def]
    server = redis_server_factory()
    backend = LockStore(server.url, {"socket_timeout": 0.5, "socket_connect_timeout": 0.5})
    server.kill()
    started = time.monotonic()
    with pytest.raises(
        LockBackendError,
        match=r"cannot acquire lock 'k': Redis at redis://127.0.0.1:\d+ is unavailable",
    ):
        backend.acquire("k", "v", 1000)
    assert time.monotonic() - started < 10  # bounded by the client timeouts, not hanging


def test_wrong_password_is_a_clear_error(redis_server_factory) -> None:  # type: ignore[no-untyped-def]
    server = redis_server_factory("--requirepass", "s3cret")
    backend = LockStore(f"redis://:wrong@127.0.0.1:{server.port}/0")
    with pytest.raises(LockBackendError, match=r"unavailable|refused") as info:
        backend.acquire("k", "v", 1000)
    assert "wrong" not in str(info.value)  # the password is not echoed


def test_redis_refusing_scripts_is_a_clear_error(redis_server_factory) -> None:  # type: ignore[no-untyped-def]
    server = redis_server_factory()
    admin = server.client()
    admin.acl_setuser(
        "noscript",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        commands=["+@all", "-eval", "-evalsha"],
    )
    backend = LockStore(f"redis://noscript:pw@127.0.0.1:{server.port}/0")
    # A free key is taken with a plain SET (issue 24); a fenced lock's release
    # is a script on every server (a plain one is DELIFEQ on Valkey 9).
    assert backend.acquire("k", "v", 1000).acquired
    with pytest.raises(LockBackendError, match=r"refused to release lock 'k'.*must allow EVAL"):
        backend.release("k", "v", fenced=True)


def test_wait_is_woken_by_the_release_not_by_the_ttl(backend: LockStore) -> None:
    import threading

    backend.acquire("k", "holder", 30000)
    threading.Timer(0.3, lambda: backend.release("k", "holder")).start()
    result = backend.acquire_waiting("k", "waiter", 30000, timeout=20)
    assert result.acquired
    # The holder's lock still had ~29.7 s to live: only the release notification
    # (or a lost-message fallback at the TTL) could have woken us this early.
    assert backend.inspect("k")[0] == "waiter"


def test_wait_times_out_while_the_holder_keeps_it(backend: LockStore) -> None:
    backend.acquire("k", "holder", 30000)
    result = backend.acquire_waiting("k", "waiter", 30000, timeout=0.3)
    assert not result.acquired and result.holder == "holder"


def test_direct_path_reconnects_after_the_server_drops_the_connection(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    """A pooled connection killed by the server is replaced by the client's retry."""
    assert backend.acquire("k", "v1", 5000).acquired
    killed = lock_client.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    assert backend.acquire("k", "v1", 5000).acquired
    assert backend.release("k", "v1") is ReleaseOutcome.RELEASED
    assert lock_client.exists("k") == 0


@pytest.mark.parametrize(
    "options",
    [{"single_connection_client": True}, {"protocol": 2}, {"encoding": "latin-1"}],
    ids=["single-connection", "resp2", "latin-1"],
)
def test_lock_scripts_on_other_client_shapes(
    server: RedisServer, lock_client: redis.Redis, options: dict[str, object]
) -> None:
    """Clients the direct path does not serve go through evalsha; both give the same outcomes."""
    backend = LockStore(client=redis.Redis.from_url(server.url_for(LOCK_DB), **options))
    value = "v1|t-é|0|hôte|1|n|tâche|0"
    taken = backend.acquire("clé", value, 5000)
    assert taken.acquired and (backend.fence("clé", value) or 0) > 0
    contended = backend.acquire("clé", "other", 5000)
    assert not contended.acquired and contended.holder_task_id == "t-é"
    assert backend.release("clé", value) is ReleaseOutcome.RELEASED
    encoding = str(options.get("encoding", "utf-8"))
    assert lock_client.exists("clé".encode(encoding)) == 0


@pytest.mark.parametrize("encoding", ["utf-16", "utf-8-sig", "no-such-codec"])
def test_an_encoding_that_does_not_write_ascii_as_ascii_is_refused_by_name(
    server: RedisServer, lock_client: redis.Redis, encoding: str
) -> None:
    """Command names go out as ASCII bytes: such an encoding cannot talk to Redis.

    Before, the acquire's ``SET`` went out with ASCII names and a UTF-16 key
    (taken), then every release was refused: a lock held to its TTL
    (review helper-39 F1). Now the store says why, and sends nothing.
    """
    import asyncio

    from celery_redislock import ConfigurationError
    from celery_redislock.aiostore import AsyncLockStore

    store = LockStore(f"{server.url_for(LOCK_DB)}?encoding={encoding}")
    with pytest.raises(ConfigurationError, match=encoding):
        store.acquire("k", "v1", 5000)
    store.close()

    async def acquire_async() -> None:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(f"{server.url_for(LOCK_DB)}?encoding={encoding}")
        async_store = AsyncLockStore(client)
        try:
            await async_store.acquire("k", "v1", 5000)
        finally:
            await async_store.aclose()
            await client.aclose()

    with pytest.raises(ConfigurationError, match=encoding):
        asyncio.run(acquire_async())
    assert lock_client.dbsize() == 0


def test_direct_path_rejects_values_redis_cannot_take(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    with pytest.raises(TypeError, match="cannot send float"):
        backend.acquire("k", "v1", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot send NoneType"):
        backend.acquire("k", "v1", 1000, adopt=(None,))  # type: ignore[arg-type]
    assert lock_client.exists("k") == 0  # refused before anything was sent


def test_a_fork_while_another_thread_builds_connections_does_not_deadlock_the_child(
    server: RedisServer,
) -> None:
    import os
    import threading

    backend = LockStore(server.url_for(LOCK_DB))
    backend.acquire("before-fork", "v", 5000)
    holding, release = threading.Event(), threading.Event()

    def builder() -> None:  # another thread, inside the backend's guard at fork time
        with backend._guard:
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=builder)
    thread.start()
    holding.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: its first use must not wait for a lock nobody will release
        import signal

        signal.alarm(5)
        try:
            os._exit(0 if backend.acquire("in-child", "v", 5000).acquired else 1)
        except BaseException:
            os._exit(2)
    release.set()
    thread.join(5)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_wait_on_a_store_that_cannot_subscribe_gives_up_after_one_timeout(
    redis_server_factory: object,
) -> None:
    """Only a subscription that came up and then dropped is re-made: a frozen
    store fails the wait within the README's bound for one command,
    (retries + 1) x (connect + socket timeout) + retries x 0.2 s, not once
    per resubscription."""
    store: RedisServer = redis_server_factory()  # type: ignore[operator]
    backend = LockStore(
        store.url_for(LOCK_DB), {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}
    )
    store.pause()
    try:
        started = time.monotonic()
        with pytest.raises(LockBackendError):
            backend.acquire_waiting("frozen", "mine", 5000, timeout=30)
        took = time.monotonic() - started
    finally:
        store.resume()
    bound = (2 + 1) * (0.5 + 0.5) + 2 * 0.2
    assert took < bound, f"gave up after {took:.2f}s (bound {bound:.1f}s)"


def test_take_backs_share_one_thread(backend: LockStore) -> None:
    """A burst of unanswered acquires queues take-backs, not threads."""
    import threading

    from celery_redislock import takeback

    for n in range(100):
        takeback.take_back_value(backend, f"gone-{n}", "never-landed", now=False)
    threads = [t for t in threading.enumerate() if t.name == "redislock-take-back"]
    assert len(threads) == 1
    assert takeback.pending() >= 100
    backend.acquire("late", "late-value", 30000)  # an acquire that "lands late"
    takeback.take_back_value(backend, "late", "late-value")
    assert backend.acquire("late", "someone", 1000).acquired


def test_an_unanswered_acquire_is_taken_back_when_it_lands_after_the_first_attempt(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    """The first attempt finds the key empty: the acquire may not have run yet.

    Whatever the value's TTL, a key found empty does not settle the take-back
    of an acquire whose reply never came (the signal storm once left a key
    for its whole TTL this way).
    """
    from celery_redislock import takeback

    takeback.take_back_value(backend, "lands-late", "late-value", ttl=30.0)
    assert lock_client.get("lands-late") is None
    lock_client.set("lands-late", "late-value", px=30_000)  # the acquire lands now
    wait_until(lambda: lock_client.get("lands-late") is None, timeout=5)


def test_a_held_value_found_gone_settles_its_take_back(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    """A lock known to be held (its release never ran) that expired is not retried for its TTL."""
    from celery_redislock import takeback

    def queued_for(key: str) -> int:
        heap = list(takeback._WORKER._heap)
        cells = [c.cell_contents for *_, attempt in heap for c in attempt.__closure__ or ()]
        return cells.count(key)

    takeback.take_back_value(backend, "expired-already", "held-value", ttl=600.0, landed=True)
    assert queued_for("expired-already") == 0
    lost = f"reply-lost-{uuid.uuid4()}"
    takeback.take_back_value(backend, lost, "lost-reply", ttl=600.0)
    assert queued_for(lost) == 1


class CountingStore(LockStore):
    """A store subclass using the override points, as a user would to instrument it."""

    calls: list[str]

    def do_acquire(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("acquire")
        return super().do_acquire(*args, **kwargs)

    def do_release(self, *args: Any, **kwargs: Any) -> int:
        self.calls.append("release")
        return super().do_release(*args, **kwargs)

    def do_extend(self, *args: Any, **kwargs: Any) -> int:
        self.calls.append("extend")
        return super().do_extend(*args, **kwargs)


def test_a_store_subclass_serves_the_standalone_lock(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    store = CountingStore(client=lock_client)
    store.calls = []
    lock = RedisLock(lock_client, "hooked", ttl=5, store=store)
    with lock:
        assert lock_client.get("hooked") is not None
        lock.extend()
    assert lock_client.get("hooked") is None
    assert store.calls == ["acquire", "extend", "release"]

    @RedisLock(lock_client, "hooked-decorator", ttl=5, store=store)
    def decorated() -> bool:
        return lock_client.get("hooked-decorator") is not None

    store.calls = []
    assert decorated() is True
    assert store.calls == ["acquire", "release"]  # the decorator's locks use the store too


def test_a_fork_while_another_thread_builds_a_store_never_deadlocks_the_child(
    lock_client: redis.Redis,
) -> None:
    """The shared-store guard may be held by another thread at the fork."""
    import os
    import signal
    import threading

    from celery_redislock import store as store_module

    held, release = threading.Event(), threading.Event()

    def hold_the_guard() -> None:
        with store_module._SHARED_GUARD:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_guard)
    holder.start()
    held.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: a new client needs the guard
        signal.alarm(5)
        try:
            kwargs = lock_client.connection_pool.connection_kwargs
            child_client = redis.Redis(port=kwargs["port"], db=kwargs["db"])
            lock = RedisLock(child_client, "forked", ttl=5)
            os._exit(0 if lock.acquire(blocking=False) and lock.release() else 3)
        except BaseException as exc:
            os.write(2, f"child: {exc!r}\n".encode())
            os._exit(4)
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


def test_a_store_class_setting_serves_the_tasks(app_factory: Any) -> None:
    app = app_factory(
        redislock_store_class="tests.integration.test_store:CountingStore", task_always_eager=True
    )
    store = app_settings(app).backend
    assert isinstance(store, CountingStore)
    store.calls = []

    @app.task(base=SingletonTask, shared=False)
    def job(n: int) -> int:
        return n * 2

    assert job.delay(21).get() == 42
    assert store.calls == ["acquire", "release"]


class KeyRecordingStore(LockStore):
    """Records the key objects the store is handed."""

    keys: list[Any]

    def do_acquire(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.keys.append(key)
        return super().do_acquire(key, *args, **kwargs)

    def do_release(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.keys.append(key)
        return super().do_release(key, *args, **kwargs)


def test_an_execution_builds_its_key_family_once_and_hands_it_to_the_store(
    app_factory: Any,
) -> None:
    app = app_factory(
        redislock_store_class="tests.integration.test_store:KeyRecordingStore",
        task_always_eager=True,
    )
    store = app_settings(app).backend
    assert isinstance(store, KeyRecordingStore)
    store.keys = []

    @app.task(base=SingletonTask, shared=False)
    def job(n: int) -> int:
        return n * 2

    assert job.delay(21).get() == 42
    acquired, released = store.keys
    assert type(acquired) is KeyFamily and released is acquired  # one object, handed down
    assert acquired == job.lock_key_for((21,), {})


class _TransparentProxy:
    """An instrumentation-style proxy: ``__class__`` answers for the wrapped client."""

    def __init__(self, wrapped: Any) -> None:
        object.__setattr__(self, "_wrapped", wrapped)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


def test_a_proxy_class_is_not_taken_for_one_kind_of_client(
    server: RedisServer, lock_client: redis.Redis
) -> None:
    # One proxy class may wrap a plain client and a cluster client: what one
    # proxied client is says nothing about the next (review helper-41 F4).
    from redis.cluster import RedisCluster

    from celery_redislock.store import _is_cluster

    class FakeCluster(RedisCluster):  # never connects: only its class is asked
        def __init__(self) -> None:
            pass

    proxied = _TransparentProxy(lock_client)
    assert isinstance(proxied, redis.Redis) and not _is_cluster(proxied)
    assert _is_cluster(_TransparentProxy(FakeCluster()))
    assert not _is_cluster(proxied)
    lock = RedisLock(proxied, "proxied", ttl=5)  # type: ignore[arg-type]
    with lock:
        assert lock_client.exists("proxied")


@pytest.mark.parametrize("marked", [True, False], ids=["waited-for", "nobody-waits"])
def test_a_kept_release_tells_its_hook_when_someone_waits_behind_the_window(
    backend: LockStore, lock_client: redis.Redis, marked: bool
) -> None:
    # A kept key hands itself to nobody: a sweep does when it expires, so the
    # sweep must be told when that is, and only when a call is parked or
    # waits (review helper-46 F1: every held run added an index member).
    told: list[tuple[str, int]] = []
    backend.on_kept_waited = lambda key, kept_ms: told.append((key, kept_ms))
    value = "v1|id|0|h|1|n|t|0"
    assert backend.acquire("k", value, 5000).acquired
    if marked:
        lock_client.append("k", "|w")  # what a parked call or a waiter does
    kept = "v1|id|0|<done>|0|n2|t|0"
    assert backend.release("k", value, keep=kept, keep_ms=2000) is ReleaseOutcome.RELEASED
    assert told == ([("k", 2000)] if marked else [])
    assert lock_client.get("k") == (kept + "|w" if marked else kept).encode()
    # Sent again after a lost reply: it finds the kept value, and says the same.
    told.clear()
    assert backend.release("k", value, kept, 2000, resent=True) is ReleaseOutcome.RELEASED
    assert told == ([("k", 2000)] if marked else [])


def test_a_kept_release_whose_hook_fails_still_reports_released(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    def failing(key: str, kept_ms: int) -> None:
        raise LockBackendError("the index is unreachable")

    backend.on_kept_waited = failing
    value = "v1|id|0|h|1|n|t|0"
    assert backend.acquire("k", value, 5000).acquired
    lock_client.append("k", "|w")
    assert backend.release("k", value, "kept", 2000) is ReleaseOutcome.RELEASED


def test_an_interruption_inside_the_kept_release_hook_is_not_swallowed(
    backend: LockStore, lock_client: redis.Redis
) -> None:
    # A soft time limit (an Exception subclass) landing in the hook's round
    # trip must reach give_back, which sends the release again and re-raises
    # (review helper-47 F1: the task reported SUCCESS).
    from celery.exceptions import SoftTimeLimitExceeded

    def interrupted(key: str, kept_ms: int) -> None:
        raise SoftTimeLimitExceeded()

    backend.on_kept_waited = interrupted
    value = "v1|id|0|h|1|n|t|0"
    assert backend.acquire("k", value, 5000).acquired
    lock_client.append("k", "|w")
    with pytest.raises(SoftTimeLimitExceeded):
        backend.release("k", value, "kept", 2000)
    assert lock_client.get("k") == b"kept|w"  # released (kept) before the hook ran
