import pytest

from pgflow.retry import Decision, Policy, backoff_delay, decide

POLICY = Policy(max_attempts=3, backoff_s=30, max_backoff_s=3600, jitter=False,
                no_retry_exit_codes=(2,))


def test_backoff_doubles_and_is_capped() -> None:
    delays = [backoff_delay(a, 30, 3600, jitter=False) for a in range(1, 10)]
    assert delays[:4] == [30, 60, 120, 240]
    assert max(delays) == 3600 and delays[-1] == 3600


def test_full_jitter_draws_between_zero_and_the_ceiling() -> None:
    assert backoff_delay(3, 30, 3600, jitter=True, draw=lambda: 0.0) == 0
    assert backoff_delay(3, 30, 3600, jitter=True, draw=lambda: 0.5) == 60
    assert backoff_delay(1000, 30, 3600, jitter=True, draw=lambda: 0.999) <= 3600


@pytest.mark.parametrize(
    ("outcome", "attempt", "kwargs", "state"),
    [("succeeded", 1, {}, "succeeded"),
     ("failed", 1, {}, "retrying"),
     ("timed_out", 2, {}, "retrying"),
     ("lost", 1, {}, "retrying"),
     ("failed", 3, {}, "failed"),
     ("failed", 1, {"exit_code": 2}, "failed"),
     ("failed", 1, {"exit_code": 75}, "retrying"),
     ("failed", 1, {"permanent": True}, "failed"),
     ("cancelled", 1, {}, "cancelled"),
     ("lost", 1, {"cancel_requested": True}, "cancelled"),
     ("interrupted", 3, {}, "queued")],
)
def test_decisions(outcome: str, attempt: int, kwargs: dict[str, object], state: str) -> None:
    assert decide(outcome, attempt, 3, POLICY, **kwargs).state == state  # type: ignore[arg-type]


def test_retry_delay_follows_the_policy() -> None:
    assert decide("failed", 2, 3, POLICY) == Decision("retrying", 60)


def test_deleted_job_is_not_retried() -> None:
    assert decide("failed", 1, 3, None).state == "failed"
