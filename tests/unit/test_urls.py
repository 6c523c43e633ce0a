"""Redis URLs in messages never show their password."""

from __future__ import annotations

import pytest

from celery_redislock.urls import mask_url


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://:pw@h:1/2", "redis://:**@h:1/2"),
        ("redis://user:pw@h/0", "redis://user:**@h/0"),
        ("sentinel://u:pw@h1:26379,h2:26379/svc/0", "sentinel://u:**@h1:26379,h2:26379/svc/0"),
        ("unix://:pw@/tmp/x.sock?db=1", "unix://:**@/tmp/x.sock?db=1"),
        ("redis://h/0?password=abc&db=1", "redis://h/0?password=**&db=1"),
        ("redis://h:1", "redis://h:1"),
        # Raw, unencoded characters in a generated password.
        ("redis://user:Zx81kQ/pw@127.0.0.1:1/0", "redis://user:**@127.0.0.1:1/0"),
        ("redis://user:Zx81kQ?pw@127.0.0.1:1/0", "redis://user:**@127.0.0.1:1/0"),
        ("redis://user:a#b@c@127.0.0.1:1/0", "redis://user:**@127.0.0.1:1/0"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


@pytest.mark.parametrize(
    "url",
    [
        "unix:///tmp/redis.sock?db=0&password=Zx81kQ@pw99Secret",
        "redis://h:1/0?password=Zx81kQ@pw99Secret",
        "redis://user:Zx81kQ@pw99Secret@h:1/0?password=Zx81kQ@pw99Secret",
    ],
)
def test_a_password_with_an_at_sign_in_the_query_is_masked(url: str) -> None:
    for drop in (False, True):
        masked = mask_url(url, drop_credentials=drop)
        assert "pw99Secret" not in masked and "Zx81kQ" not in masked, masked


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        # A userinfo password holding what looks like a query parameter.
        ("redis://:Zq7TopSecretVal;pw=x@127.0.0.1:6000/0", "Zq7TopSecretVal"),
        ("redis://:Zq7TopSecretVal&pass=x@127.0.0.1:6000/0", "Zq7TopSecretVal"),
        # redis-py decodes the name "pass%77ord" to "password".
        ("redis://127.0.0.1:6000/0?pass%77ord=Zq7TopSecretVal", "Zq7TopSecretVal"),
        # The tail of a query password after a raw "#" or "&".
        ("redis://127.0.0.1:6000/0?password=Zq7#TopSecretVal", "TopSecretVal"),
        ("redis://127.0.0.1:6000/0?password=Zq7&TopSecretVal", "TopSecretVal"),
        ("rediss://127.0.0.1:6000/0?ssl_password=Zq7TopSecretVal", "Zq7TopSecretVal"),
    ],
)
def test_no_reading_of_a_url_shows_its_secret(url: str, secret: str) -> None:
    for drop in (False, True):
        masked = mask_url(url, drop_credentials=drop)
        assert secret not in masked, masked
        assert "127.0.0.1:6000" in masked, masked  # the address is still shown
