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
