"""What a release's attempts mean (``protocol.ReleaseAttempts``): pure, no server."""

from __future__ import annotations

from celery_redislock.protocol import ReleaseAttempts, after_retry


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
