"""Cron schedules evaluated in a job's own time zone.

**croniter is the cron engine.** It reads the fields (numbers, month and day
names, ``*``, ranges, lists, steps, the ``@hourly`` ... ``@yearly`` aliases),
applies Vixie cron's day rule (day-of-month and day-of-week are OR-ed when both
are restricted, AND-ed when either field starts with ``*``) and steps from one
wall-clock time to the next matching one, forwards or backwards. It is only ever
handed naive local wall-clock times.

**pgflow adds what croniter does not do its way:**

* The contract's syntax. Six fields put seconds *first*
  (``sec min hour dom month dow``); croniter wants them last, so they are moved.
  croniter extensions that crontab(5) lacks (``L``, ``W``, ``#``, ``?``, ``H``,
  a year field, wrap-around ranges such as ``sat-sun``) are refused, and every
  refusal is a one-line CronError naming the field, decided before croniter sees
  the text. ``N/S`` means ``N-max/S``; ``N-N`` is just ``N`` (croniter would
  read it as the whole cycle, so pgflow spells it as ``N``); day-of-week 7 is
  Sunday.
* Time zones. croniter's own zone handling fires ``30 2 * * *`` twice on a
  fall-back night, which Vixie cron does not. pgflow computes ticks in local
  wall-clock time and places them on the UTC line itself:

  - A wall time skipped by a spring-forward gap fires once, at the first instant
    after the gap (the transition itself). All ticks inside one gap collapse
    into that single fire, which merges with a tick due at that instant anyway.
  - A wall time repeated by a fall-back fires once, at its first occurrence,
    when the hour field is fixed (``30 2 * * *``, ``0 1-3 * * *``). When the
    hour field starts with ``*`` (``*``, ``*/2``, ``@hourly``) it fires at both
    occurrences, like Vixie cron's wildcard jobs (Vixie also counts a ``*``
    minute field as wildcard; here only the hour field decides).

Fire instants come out in strictly increasing UTC order without duplicates.
"""

from __future__ import annotations

import calendar
import re
import threading
import zoneinfo
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from typing import Any, NamedTuple

from croniter import CroniterError, croniter

from pgflow.errors import PgflowError

MAX_EXPRESSION_LENGTH = 256
LOOKBACK = timedelta(days=400)

# croniter expands these itself; pgflow only needs their names for messages.
ALIASES: tuple[str, ...] = (
    "@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly",
)

_ONE_SECOND = timedelta(seconds=1)
_ONE_MICROSECOND = timedelta(microseconds=1)

# Field positions in croniter's order (seconds, when present, come last).
_HOUR, _DAY, _MONTH, _WEEKDAY = 1, 2, 3, 4
# Any (month, day, weekday) of a valid date recurs within one 400-year Gregorian
# cycle, so a search that long never gives up on an expression pgflow accepts.
_MAX_YEARS = 400
# Questions remembered per expression: jobs sharing a schedule ask the same ones.
_MEMO_SIZE = 8

_UTC_NAMES = frozenset({
    "UTC", "Etc/UTC", "UCT", "Etc/UCT", "Universal", "Etc/Universal", "Zulu", "Etc/Zulu",
    "GMT", "Etc/GMT", "GMT0", "GMT+0", "GMT-0", "Etc/GMT0", "Etc/GMT+0", "Etc/GMT-0",
    "Greenwich", "Etc/Greenwich",
})
_TZ_NAME_RE = re.compile(r"[A-Za-z0-9_+-]+(?:/[A-Za-z0-9_+-]+)*")
# Present in the system zone folder but not zones a job should run in:
# "right/*" counts leap seconds, "localtime" depends on the machine.
_TZ_EXCLUDED_DIRS = frozenset({"posix", "right"})
_TZ_EXCLUDED_NAMES = frozenset({"localtime", "posixrules"})


class CronError(PgflowError, ValueError):
    """A cron expression or time zone is invalid (a ValueError too, so pydantic
    validators report it as a field error)."""


class _Invalid(Exception):
    """Why an expression is invalid; wrapped into a CronError naming it."""


def _show(text: str) -> str:
    """Quote user text on one line, shortened if long."""
    return repr(text if len(text) <= 60 else text[:57] + "...")


# --- time zones --------------------------------------------------------------


def load_timezone(name: str) -> zoneinfo.ZoneInfo:
    """The IANA zone called ``name``; CronError if there is none."""
    if not isinstance(name, str):
        raise CronError(f"timezone must be a string, not {type(name).__name__}")
    if _is_plausible_zone_name(name):
        try:
            return zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError, UnicodeError):
            pass
    raise CronError(
        f"unknown timezone {_show(name)} (use an IANA name such as Europe/Berlin)"
    )


def _is_plausible_zone_name(name: str) -> bool:
    if len(name) > 128 or not _TZ_NAME_RE.fullmatch(name):
        return False
    return name not in _TZ_EXCLUDED_NAMES and name.split("/")[0] not in _TZ_EXCLUDED_DIRS


# --- checking the text (croniter does the expanding) -------------------------


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    star_high: int  # '*' and 'N/S' stop here (day-of-week: 6, although 7 is accepted)
    names: Mapping[str, int] = field(default_factory=dict)


_MONTH_NAMES = {name.lower(): i for i, name in enumerate(calendar.month_abbr) if name}
_DAY_NAMES = {"sun": 0, "mon": 1, "tue": 2, "wed": 3, "thu": 4, "fri": 5, "sat": 6}

_SECOND = _Field("second", 0, 59, 59)
_WEEKDAY_FIELD = _Field("day-of-week", 0, 7, 6, _DAY_NAMES)
_FIELDS_5 = (
    _Field("minute", 0, 59, 59),
    _Field("hour", 0, 23, 23),
    _Field("day-of-month", 1, 31, 31),
    _Field("month", 1, 12, 12, _MONTH_NAMES),
    _WEEKDAY_FIELD,
)
_FIELDS_6 = (_SECOND, *_FIELDS_5)
_LONGEST_MONTH = {month: calendar.monthrange(2024, month)[1] for month in range(1, 13)}


def _value(token: str, spec: _Field) -> int:
    if token.isdigit():
        number = int(token)
    elif token.lower() in spec.names:
        return spec.names[token.lower()]
    else:
        kind = "a number" if not spec.names else f"a number or a {spec.name} name"
        raise _Invalid(f"{spec.name} field: {token!r} is not {kind}")
    if not spec.low <= number <= spec.high:
        raise _Invalid(
            f"{spec.name} field value {number} is out of range {spec.low}-{spec.high}"
        )
    return number


def _check_step(token: str, spec: _Field) -> None:
    if not token.isdigit() or not 1 <= int(token) <= spec.star_high - spec.low + 1:
        raise _Invalid(
            f"{spec.name} field: step {token!r} must be a number from 1 to"
            f" {spec.star_high - spec.low + 1}"
        )


def _bounds(base: str, spec: _Field, stepped: bool) -> tuple[int, int]:
    """The first and last value a non-``*`` item names (before its step)."""
    if "-" in base:
        first, _, last = base.partition("-")
        low, high = _value(first, spec), _value(last, spec)
        if low > high:
            hint = " (Sunday is 0 or 7)" if spec is _WEEKDAY_FIELD else ""
            raise _Invalid(f"{spec.name} field: range {base!r} runs backwards{hint}")
        return low, high
    low = _value(base, spec)
    return low, (max(low, spec.star_high) if stepped else low)


def _item_text(item: str, spec: _Field, leading: bool) -> str:
    """Check one list item and spell it for croniter. croniter reads ``N-N`` as
    the whole cycle (6.x also ``59/15``), so a one-value item becomes ``N``; and a
    ``*`` after the first item would switch its day rule to AND, so it becomes an
    explicit range."""
    base, slash, step = item.partition("/")
    if slash:
        _check_step(step, spec)
    if base == "*":
        return item if leading or slash else f"{spec.low}-{spec.star_high}"
    low, high = _bounds(base, spec, bool(slash))
    return str(low) if low == high else item


def _field_text(text: str, spec: _Field) -> str:
    items = text.split(",")
    spelled = []
    for position, item in enumerate(items):
        if not item:
            raise _Invalid(f"{spec.name} field {text!r} has an empty list item")
        spelled.append(_item_text(item, spec, position == 0))
    return ",".join(spelled)


def _check_characters(expr: str) -> None:
    if len(expr) > MAX_EXPRESSION_LENGTH:
        raise _Invalid(f"it is {len(expr)} characters long (at most {MAX_EXPRESSION_LENGTH})")
    for char in expr:
        if (char < " " and char != "\t") or char == "\x7f":
            raise _Invalid(f"it contains the control character {char!r}")
        if char > "\x7f":
            raise _Invalid(f"it contains the non-ASCII character {char!r}")


def _croniter_text(expr: str) -> str:
    """``expr`` checked and rewritten in croniter's syntax (seconds last)."""
    text = expr.strip()
    if not text:
        raise _Invalid("it is empty")
    if text.startswith("@"):
        if text.lower() not in ALIASES:
            raise _Invalid(f"{text!r} is not supported (aliases: {', '.join(ALIASES)})")
        return text.lower()
    fields = text.split()
    if len(fields) not in (5, 6):
        raise _Invalid(
            f"expected 5 fields (minute hour day-of-month month day-of-week) or 6 (second"
            f" first), got {len(fields)}"
        )
    specs = _FIELDS_6 if len(fields) == 6 else _FIELDS_5
    spelled = [_field_text(item, spec) for spec, item in zip(specs, fields, strict=True)]
    return " ".join(spelled[1:] + spelled[:1] if len(spelled) == 6 else spelled)


# --- the engine ----------------------------------------------------------------


def _croniter(text: str) -> croniter:
    try:
        return croniter(
            text, datetime(2000, 1, 1), ret_type=datetime, day_or=True,
            implement_cron_bug=True,  # Vixie: a day field starting with '*' means AND
            max_years_between_matches=_MAX_YEARS,
        )
    except CroniterError as exc:  # a form pgflow passed but croniter refuses
        lines = str(exc).strip().splitlines() or ["refused"]
        raise _Invalid(f"croniter cannot read it ({lines[-1][:120]})") from None


def _allowed(expanded: Sequence[Any], everything: range) -> list[int]:
    return list(everything) if expanded[0] == "*" else [int(value) for value in expanded]


def _check_can_fire(iterator: croniter) -> None:
    """Reject day/month combinations that never occur, such as ``0 0 30 2 *``."""
    days = _allowed(iterator.expanded[_DAY], range(1, 32))
    months = _allowed(iterator.expanded[_MONTH], range(1, 13))
    if not any(day <= _LONGEST_MONTH[month] for day in days for month in months):
        raise _Invalid(
            f"day {','.join(map(str, days))} never occurs in month"
            f" {','.join(map(str, months))}, so it would never run"
        )


class _Engine:
    """One expression compiled by croniter, stepping through naive wall-clock times.

    A croniter object carries its current time, so calls are serialised by a lock
    (web and scheduler threads share compiled expressions). Answers are memoised:
    thousands of jobs on one schedule ask croniter the same question.
    """

    __slots__ = ("_iterator", "_lock", "_memo", "has_seconds", "hour_star")

    def __init__(self, iterator: croniter) -> None:
        self._iterator = iterator
        self._lock = threading.Lock()
        self._memo: dict[tuple[datetime, bool], datetime | None] = {}
        self.has_seconds = len(iterator.expanded) == 6
        self.hour_star = iterator.expressions[_HOUR].startswith("*")

    def next_local(self, after: datetime) -> datetime:
        """The first matching wall-clock time strictly after naive ``after``."""
        found = self._ask(after.replace(microsecond=0), forward=True)
        if found is None:
            raise OverflowError("no matching wall-clock time before year 10000")
        return found

    def local_at_or_before(self, moment: datetime, floor: date) -> datetime | None:
        """The last matching wall-clock time at or before naive ``moment``, not before
        ``floor``."""
        # Ticks fall on whole seconds: "at or before moment" is "before the next second".
        found = self._ask(moment.replace(microsecond=0) + _ONE_SECOND, forward=False)
        if found is None or found.date() < floor:
            return None
        return found

    def _ask(self, start: datetime, forward: bool) -> datetime | None:
        key = (start, forward)
        with self._lock:
            if key not in self._memo:
                if len(self._memo) >= _MEMO_SIZE:
                    self._memo.clear()
                self._memo[key] = self._step(start, forward)
            return self._memo[key]

    def _step(self, start: datetime, forward: bool) -> datetime | None:
        """croniter's next (or previous) match strictly after (before) ``start``;
        None when it runs off the calendar (years 1-9999) without one."""
        try:
            if forward:
                found = self._iterator.get_next(datetime, start)
            else:
                found = self._iterator.get_prev(datetime, start)
        except (ValueError, OverflowError, OSError):  # CroniterBadDateError is a ValueError
            return None
        assert isinstance(found, datetime)
        return found


def _build(expr: str) -> _Engine:
    _check_characters(expr)
    iterator = _croniter(_croniter_text(expr))
    day_field, weekday_field = (iterator.expressions[i] for i in (_DAY, _WEEKDAY))
    if day_field.startswith("*") or weekday_field.startswith("*"):  # AND
        _check_can_fire(iterator)
    elif "*" in (iterator.expanded[_DAY][0], iterator.expanded[_WEEKDAY][0]):
        # OR with a field croniter found complete ('1-31'): every day matches, but
        # croniter would AND the fields. Say "every day" in its own terms.
        fields = list(iterator.expressions)
        fields[_DAY] = fields[_WEEKDAY] = "*"
        iterator = _croniter(" ".join(fields))
    return _Engine(iterator)


@lru_cache(maxsize=16384)  # about 1 KB each
def _compile(expr: str) -> _Engine:
    """Parse once per distinct expression: thousands of jobs share a few schedules."""
    try:
        return _build(expr)
    except _Invalid as exc:
        raise CronError(f"invalid cron expression {_show(expr)}: {exc}") from None


# --- schedules ---------------------------------------------------------------


class _Fold(NamedTuple):
    """A stretch of wall-clock time [start, end) that a fall-back repeats."""

    start: datetime
    end: datetime
    pre: timedelta  # UTC offset during the first occurrence
    post: timedelta  # UTC offset during the repeat


def _utc_naive(moment: datetime, what: str) -> datetime:
    if not isinstance(moment, datetime) or moment.utcoffset() is None:
        raise ValueError(f"{what} must be a timezone-aware datetime, got {moment!r}")
    return moment.astimezone(UTC).replace(tzinfo=None)


def _aware(utc: datetime) -> datetime:
    return utc.replace(tzinfo=UTC)


class CronSchedule:
    """A validated cron expression bound to a time zone.

    Instants are handled internally as naive UTC datetimes and wall-clock times
    as naive local datetimes; croniter finds the wall-clock ticks, this class
    places them on the UTC line. A croniter step costs tens of microseconds (a
    few times the old hand-written matcher), hence the per-expression memo.
    """

    __slots__ = ("_matcher", "_tz", "_utc", "expr", "has_seconds", "timezone")

    def __init__(self, expr: str, timezone: str = "UTC") -> None:
        if not isinstance(expr, str):
            raise CronError(f"cron expression must be a string, not {type(expr).__name__}")
        self._matcher = _compile(expr)
        self._tz = load_timezone(timezone)
        self._utc = timezone in _UTC_NAMES
        self.expr = expr
        self.timezone = timezone
        self.has_seconds = self._matcher.has_seconds

    def __repr__(self) -> str:
        return f"CronSchedule({self.expr!r}, timezone={self.timezone!r})"

    def next_after(self, after: datetime) -> datetime:
        """The first fire instant strictly after ``after``, as an aware UTC datetime."""
        start = _utc_naive(after, "after")
        try:
            if self._utc:
                return _aware(self._matcher.next_local(start))
            return _aware(self._next_instant(start))
        except OverflowError:
            raise self._out_of_range(after) from None

    def ticks_between(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Every fire instant ``t`` with ``start <= t < end``, increasing, in UTC."""
        first, stop = _aware(_utc_naive(start, "start")), _aware(_utc_naive(end, "end"))
        tick = self.next_after(first - _ONE_MICROSECOND)
        while tick < stop:
            yield tick
            tick = self.next_after(tick)

    def last_at_or_before(self, moment: datetime) -> datetime | None:
        """The newest fire instant at or before ``moment`` within the last 400 days."""
        end = _utc_naive(moment, "moment")
        try:
            if self._utc:
                found = self._matcher.local_at_or_before(end, (end - LOOKBACK).date())
            else:
                found = self._last_instant(end)
        except OverflowError:
            raise self._out_of_range(moment) from None
        return None if found is None else _aware(found)

    def _out_of_range(self, moment: datetime) -> CronError:
        return CronError(
            f"cron expression {_show(self.expr)} has no fire time near {moment.isoformat()}"
            " within the years 1-9999"
        )

    # The search walks wall-clock ticks. Each tick's earliest instant never
    # decreases from one tick to the next (nor does its latest), but the repeat of
    # a tick after a fall-back lies after later ticks' first occurrences (with
    # */15, 02:30 repeated comes after 02:45 first time). So the walk keeps the best
    # instant so far and stops at the first tick that cannot beat it. If the wall
    # clock of the starting instant is itself inside a repeated stretch, the
    # stretch is handled first so that a per-second schedule does not walk it.

    def _next_instant(self, after: datetime) -> datetime:
        wall, repeating = self._wall_clock(after)
        fold = self._fold_at(wall)
        best: datetime | None = None
        if fold is not None:
            best = self._first_repeat(wall if repeating else fold.start - _ONE_MICROSECOND, fold)
            if repeating:  # the first occurrences of the rest of the stretch are past
                wall = fold.end - _ONE_MICROSECOND
        local = self._matcher.next_local(wall)
        while True:
            instants = self._instants(local)
            for instant in instants:
                if instant > after and (best is None or instant < best):
                    best = instant
            if best is not None and best <= instants[0]:
                return best
            local = self._matcher.next_local(local)

    def _first_repeat(self, wall: datetime, fold: _Fold) -> datetime | None:
        """The repeat of the first tick after ``wall`` inside ``fold``, if it fires."""
        if not self._matcher.hour_star:
            return None
        local = self._matcher.next_local(wall)
        return local - fold.post if local < fold.end else None

    def _last_instant(self, moment: datetime) -> datetime | None:
        wall, repeating = self._wall_clock(moment)
        floor = (wall - LOOKBACK).date()
        fold = self._fold_at(wall)
        if fold is not None:
            local = self._matcher.local_at_or_before(wall, floor)
            if local is not None and local >= fold.start:
                # Repeats come after every first occurrence, and first occurrences in
                # the stretch after every earlier tick.
                if not repeating:
                    return local - fold.pre
                if self._matcher.hour_star:
                    return local - fold.post
            if repeating:  # first occurrences up to the end of the stretch are past
                wall = fold.end - _ONE_SECOND
        return self._walk_back(self._matcher.local_at_or_before(wall, floor), moment, floor)

    def _walk_back(self, local: datetime | None, moment: datetime, floor: date) -> datetime | None:
        best: datetime | None = None
        while local is not None:
            instants = self._instants(local)
            for instant in instants:
                if instant <= moment and (best is None or instant > best):
                    best = instant
            if best is not None and best >= instants[-1]:
                return best
            local = self._matcher.local_at_or_before(local - _ONE_SECOND, floor)
        return best

    def _wall_clock(self, utc: datetime) -> tuple[datetime, bool]:
        """The local wall-clock time of ``utc`` and whether it is a repeat."""
        local = utc.replace(tzinfo=UTC).astimezone(self._tz)
        return local.replace(tzinfo=None, fold=0), local.fold == 1

    def _fold_at(self, wall: datetime) -> _Fold | None:
        """The repeated stretch of wall-clock time containing ``wall``, if any."""
        # Offsets change on whole seconds: measure from one, or the stretch found
        # would start a fraction of a second late and miss a tick at its start.
        wall = wall.replace(microsecond=0)
        first = wall - self._wall_offset(wall, 0)
        second = wall - self._wall_offset(wall, 1)
        if first >= second:
            return None
        transition = self._transition(first, second)
        pre, post = wall - first, wall - second
        return _Fold(start=transition + post, end=transition + pre, pre=pre, post=post)

    def _instants(self, local: datetime) -> tuple[datetime, ...]:
        """The UTC instants (ascending) at which wall-clock tick ``local`` fires."""
        # PEP 495: fold=0 reads a wall time with the offset in force before a
        # transition, fold=1 with the one after. Equal offsets: an ordinary time.
        first = local - self._wall_offset(local, 0)
        second = local - self._wall_offset(local, 1)
        if first == second:
            return (first,)
        if first < second:  # the wall time happens twice (fall-back)
            return (first, second) if self._matcher.hour_star else (first,)
        return (self._transition(second, first),)  # the wall time is skipped (spring-forward)

    def _transition(self, before: datetime, after: datetime) -> datetime:
        """The instant in ``(before, after]`` at which the offset changes to the one in
        force at ``after`` (1 s precision)."""
        target = self._offset_at(after)
        low, high = 0, int((after - before).total_seconds())
        while high - low > 1:
            middle = (low + high) // 2
            if self._offset_at(before + timedelta(seconds=middle)) == target:
                high = middle
            else:
                low = middle
        return before + timedelta(seconds=high)

    def _wall_offset(self, local: datetime, fold: int) -> timedelta:
        offset = local.replace(tzinfo=self._tz, fold=fold).utcoffset()
        assert offset is not None  # a ZoneInfo always knows its offset
        return offset

    def _offset_at(self, utc: datetime) -> timedelta:
        offset = utc.replace(tzinfo=UTC).astimezone(self._tz).utcoffset()
        assert offset is not None
        return offset


def parse_cron(expr: str, timezone: str = "UTC") -> CronSchedule:
    """Validate ``expr`` in ``timezone``; raises CronError with a one-line reason."""
    return CronSchedule(expr, timezone)
