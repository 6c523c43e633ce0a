"""What a release's attempts mean (``protocol.ReleaseAttempts``): pure, no server."""

from __future__ import annotations

import pytest
from redis._parsers.base import BaseParser
from redis.exceptions import MovedError

from celery_redislock.protocol import ReleaseAttempts, after_native_release, after_retry


def test_an_attempt_whose_reply_was_lost_makes_the_next_a_retry() -> None:
    attempts = ReleaseAttempts("k")
    assert attempts.start() is False  # sent; its reply never comes
    assert attempts.start() is True
    attempts.answered()
    assert attempts.outcome(0) == 1  # gone: the first attempt released it


def test_an_error_reply_to_a_retry_keeps_the_next_attempt_a_retry() -> None:
    """MOVED, ASK or TRYAGAIN ran nothing: the attempt that may have run still may have."""
    attempts = ReleaseAttempts("k")
    attempts.start()  # lost
    assert attempts.start() is True
    attempts.refused()  # answered MOVED
    assert attempts.start() is True


def test_an_error_reply_to_a_first_attempt_is_not_a_lost_reply() -> None:
    attempts = ReleaseAttempts("k")
    assert attempts.start() is False
    attempts.refused()  # answered TRYAGAIN: nothing ran
    assert attempts.start() is False
    attempts.answered()
    assert attempts.outcome(0) == 0


def test_a_re_sent_release_starts_as_a_retry() -> None:
    attempts = ReleaseAttempts("k", resent=True)
    assert attempts.start() is True


def test_a_retry_that_finds_another_holder_says_so() -> None:
    """It cannot tell a first attempt that freed the key (then retaken) from a lock lost before."""
    assert after_retry("k", -1) == -1
    assert after_retry("k", 0) == 1
    assert after_retry("k", 1) == 1
    assert after_retry("k", [1, "h", b"m"]) == [1, "h", b"m"]


@pytest.mark.parametrize(
    "text",
    [
        "unknown command 'DELIFEQ', with args beginning with: 'k' 'v'",  # Redis 7
        "NOPERM User locker has no permissions to run the 'delifeq' command",  # an ACL
        "unsupported command 'delifeq'",  # a proxy's wording (helper-36 F3)
    ],
)
def test_a_server_that_refuses_delifeq_sends_the_release_to_the_scripts(text: str) -> None:
    assert after_native_release(BaseParser.parse_error(text)) is None


def test_delifeqs_replies_say_deleted_or_not_and_other_errors_are_raised() -> None:
    assert after_native_release(1) is True
    assert after_native_release(0) is False
    with pytest.raises(MovedError):
        after_native_release(BaseParser.parse_error("MOVED 3999 127.0.0.1:6381"))
