"""What happens after an attempt ends: the run's next state and, for a retry, the delay.

Backoff is exponential with full jitter (AWS's "full jitter": a uniform draw in
[0, min(cap, base * 2^(attempt-1))]), so retries of many runs that failed
together spread out instead of stampeding a recovering source.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SUCCEEDED = "succeeded"
FAILED = "failed"
TIMED_OUT = "timed_out"
LOST = "lost"
CANCELLED = "cancelled"
INTERRUPTED = "interrupted"

EX_TEMPFAIL = 75  # a source is unavailable (sysexits.h)


@dataclass(frozen=True)
class Policy:
    max_attempts: int
    backoff_s: float
    max_backoff_s: float
    jitter: bool
    no_retry_exit_codes: Sequence[int] = ()


@dataclass(frozen=True)
class Decision:
    state: str  # succeeded | failed | cancelled | retrying | queued
    delay_s: float = 0.0


def backoff_delay(
    attempt: int, base_s: float, cap_s: float, jitter: bool,
    draw: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before the attempt after ``attempt`` (1-based)."""
    exponent = min(attempt - 1, 62)  # 2**62 * base already exceeds any cap
    ceiling = min(cap_s, base_s * (2.0**exponent))
    return ceiling * draw() if jitter else ceiling


def decide(
    outcome: str,
    attempt: int,
    max_attempts: int,
    policy: Policy | None,
    *,
    exit_code: int | None = None,
    permanent: bool = False,
    cancel_requested: bool = False,
    draw: Callable[[], float] = random.random,
) -> Decision:
    """The run's next state after ``attempt`` ended with ``outcome``.

    ``policy`` is None when the job was deleted while the run ran: no retry then.
    """
    if outcome == SUCCEEDED:
        return Decision(SUCCEEDED)
    if outcome == INTERRUPTED:
        return Decision("queued")
    if outcome == CANCELLED or cancel_requested:
        return Decision(CANCELLED)
    if policy is None or permanent or attempt >= max_attempts:
        return Decision(FAILED)
    if exit_code is not None and exit_code in policy.no_retry_exit_codes:
        return Decision(FAILED)
    delay = backoff_delay(attempt, policy.backoff_s, policy.max_backoff_s, policy.jitter, draw)
    return Decision("retrying", delay)
