"""Cron schedules evaluated in a job's own time zone.

Expressions are standard 5-field cron (``min hour dom month dow``), 6 fields
with seconds first (``sec min hour dom month dow``), or one of the aliases
``@yearly @annually @monthly @weekly @daily @midnight @hourly``. Fields accept
numbers, month/day names, ``*``, ranges, lists and steps (``N/S`` means
``N-max/S``). As in Vixie cron, day-of-month and day-of-week are OR-ed when
both are restricted, but AND-ed when either field starts with ``*``; day-of-week
7 is Sunday.

Ticks are computed in local wall-clock time and then placed on the UTC line:

* A wall time skipped by a spring-forward gap fires once, at the first instant
  after the gap (the transition itself). All ticks inside one gap collapse into
  that single fire, which merges with a tick due at that instant anyway.
* A wall time repeated by a fall-back fires once, at its first occurrence, when
  the hour field is fixed (``30 2 * * *``, ``0 1-3 * * *``). When the hour field
  starts with ``*`` (``*``, ``*/2``, ``@hourly``) it fires at both occurrences,
  like Vixie cron's wildcard jobs (Vixie also counts a ``*`` minute field as
  wildcard; here only the hour field decides).

Fire instants come out in strictly increasing UTC order without duplicates.
"""

from __future__ import annotations

import calendar
import re
import zoneinfo
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import MAXYEAR, UTC, date, datetime, timedelta
from functools import lru_cache
from typing import NamedTuple

from pgflow.errors import PgflowError

MAX_EXPRESSION_LENGTH = 256
LOOKBACK = timedelta(days=400)

_ONE_DAY = timedelta(days=1)
_ONE_SECOND = timedelta(seconds=1)
_ONE_MICROSECOND = timedelta(microseconds=1)

ALIASES: Mapping[str, str] = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

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


# --- parsing -----------------------------------------------------------------


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
_FIELDS_5 = (
    _Field("minute", 0, 59, 59),
    _Field("hour", 0, 23, 23),
    _Field("day-of-month", 1, 31, 31),
    _Field("month", 1, 12, 12, _MONTH_NAMES),
    _Field("day-of-week", 0, 7, 6, _DAY_NAMES),
)
_FIELDS_6 = (_SECOND, *_FIELDS_5)


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


def _step(token: str, spec: _Field) -> int:
    if not token.isdigit() or not 1 <= int(token) <= spec.star_high - spec.low + 1:
        raise _Invalid(
            f"{spec.name} field: step {token!r} must be a number from 1 to"
            f" {spec.star_high - spec.low + 1}"
        )
    return int(token)


def _expand_item(item: str, spec: _Field) -> range:
    base, slash, step_text = item.partition("/")
    step = _step(step_text, spec) if slash else 1
    if base == "*":
        return range(spec.low, spec.star_high + 1, step)
    if "-" in base:
        first, _, last = base.partition("-")
        low, high = _value(first, spec), _value(last, spec)
        if low > high:
            hint = " (Sunday is 0 or 7)" if spec is _FIELDS_5[-1] else ""
            raise _Invalid(f"{spec.name} field: range {base!r} runs backwards{hint}")
        return range(low, high + 1, step)
    low = _value(base, spec)
    return range(low, (max(low, spec.star_high) if slash else low) + 1, step)


def _expand_field(text: str, spec: _Field) -> frozenset[int]:
    values: set[int] = set()
    for item in text.split(","):
        if not item:
            raise _Invalid(f"{spec.name} field {text!r} has an empty list item")
        values.update(_expand_item(item, spec))
    if spec.name == "day-of-week" and 7 in values:
        values = (values - {7}) | {0}
    return frozenset(values)


def _check_characters(expr: str) -> None:
    if len(expr) > MAX_EXPRESSION_LENGTH:
        raise _Invalid(f"it is {len(expr)} characters long (at most {MAX_EXPRESSION_LENGTH})")
    for char in expr:
        if (char < " " and char != "\t") or char == "\x7f":
            raise _Invalid(f"it contains the control character {char!r}")
        if char > "\x7f":
            raise _Invalid(f"it contains the non-ASCII character {char!r}")


def _split_fields(expr: str) -> list[str]:
    text = expr.strip()
    if not text:
        raise _Invalid("it is empty")
    if text.startswith("@"):
        alias = ALIASES.get(text.lower())
        if alias is None:
            raise _Invalid(f"{text!r} is not supported (aliases: {', '.join(ALIASES)})")
        text = alias
    fields = text.split()
    if len(fields) not in (5, 6):
        raise _Invalid(
            f"expected 5 fields (minute hour day-of-month month day-of-week) or 6 (second"
            f" first), got {len(fields)}"
        )
    return fields


@dataclass(frozen=True)
class _Matcher:
    """A parsed expression: finds matching wall-clock times (naive datetimes)."""

    seconds: tuple[int, ...]
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    days_and_weekdays: bool  # Vixie: AND when either day field starts with '*'
    hour_star: bool
    has_seconds: bool

    def _day_matches(self, year: int, month: int, day: int) -> bool:
        day_ok = day in self.days
        weekday_ok = (calendar.weekday(year, month, day) + 1) % 7 in self.weekdays
        if self.days_and_weekdays:
            return day_ok and weekday_ok
        return day_ok or weekday_ok

    def _day_on_or_after(self, start: date) -> date:
        year, month, day = start.year, start.month, start.day
        while year <= MAXYEAR:
            if month in self.months:
                for candidate in range(day, calendar.monthrange(year, month)[1] + 1):
                    if self._day_matches(year, month, candidate):
                        return date(year, month, candidate)
            year, month, day = (year + 1, 1, 1) if month == 12 else (year, month + 1, 1)
        raise OverflowError("no matching day before year 10000")

    def _day_on_or_before(self, start: date, floor: date) -> date | None:
        year, month, day = start.year, start.month, start.day
        while (year, month) >= (floor.year, floor.month):
            if month in self.months:
                for candidate in range(day, 0, -1):
                    if self._day_matches(year, month, candidate):
                        found = date(year, month, candidate)
                        return found if found >= floor else None
            year, month = (year - 1, 12) if month == 1 else (year, month - 1)
            day = calendar.monthrange(year, month)[1]
        return None

    def _time_after(self, hour: int, minute: int, second: int) -> tuple[int, int, int] | None:
        if hour in self.hours:
            if minute in self.minutes:
                i = bisect_right(self.seconds, second)
                if i < len(self.seconds):
                    return hour, minute, self.seconds[i]
            i = bisect_right(self.minutes, minute)
            if i < len(self.minutes):
                return hour, self.minutes[i], self.seconds[0]
        i = bisect_right(self.hours, hour)
        if i < len(self.hours):
            return self.hours[i], self.minutes[0], self.seconds[0]
        return None

    def _time_at_or_before(
        self, hour: int, minute: int, second: int
    ) -> tuple[int, int, int] | None:
        if hour in self.hours:
            if minute in self.minutes:
                i = bisect_right(self.seconds, second)
                if i > 0:
                    return hour, minute, self.seconds[i - 1]
            i = bisect_left(self.minutes, minute)
            if i > 0:
                return hour, self.minutes[i - 1], self.seconds[-1]
        i = bisect_left(self.hours, hour)
        if i > 0:
            return self.hours[i - 1], self.minutes[-1], self.seconds[-1]
        return None

    def next_local(self, after: datetime) -> datetime:
        """The first matching wall-clock time strictly after naive ``after``."""
        if self._day_matches_date(after):
            found = self._time_after(after.hour, after.minute, after.second)
            if found is not None:
                return datetime(after.year, after.month, after.day, *found)
        day = self._day_on_or_after(after.date() + _ONE_DAY)
        return datetime(day.year, day.month, day.day, self.hours[0], self.minutes[0],
                        self.seconds[0])

    def local_at_or_before(self, moment: datetime, floor: date) -> datetime | None:
        """The last matching wall-clock time at or before naive ``moment``, not before
        ``floor``."""
        if self._day_matches_date(moment):
            found = self._time_at_or_before(moment.hour, moment.minute, moment.second)
            if found is not None:
                return datetime(moment.year, moment.month, moment.day, *found)
        day = self._day_on_or_before(moment.date() - _ONE_DAY, floor)
        if day is None:
            return None
        return datetime(day.year, day.month, day.day, self.hours[-1], self.minutes[-1],
                        self.seconds[-1])

    def _day_matches_date(self, moment: datetime) -> bool:
        return moment.month in self.months and self._day_matches(
            moment.year, moment.month, moment.day
        )


def _check_can_fire(matcher: _Matcher) -> None:
    """Reject day/month combinations that never occur, such as ``0 0 30 2 *``."""
    if not matcher.days_and_weekdays:
        return  # OR-ed with a day of the week, which occurs in every month
    longest = {month: calendar.monthrange(2024, month)[1] for month in matcher.months}
    if not any(day <= longest[month] for day in matcher.days for month in matcher.months):
        days = ",".join(str(day) for day in sorted(matcher.days))
        months = ",".join(str(month) for month in sorted(matcher.months))
        raise _Invalid(f"day {days} never occurs in month {months}, so it would never run")


def _build_matcher(texts: list[str]) -> _Matcher:
    specs = _FIELDS_6 if len(texts) == 6 else _FIELDS_5
    text = {spec.name: item for spec, item in zip(specs, texts, strict=True)}
    values = {spec.name: _expand_field(text[spec.name], spec) for spec in specs}
    return _Matcher(
        seconds=tuple(sorted(values.get("second", {0}))),
        minutes=tuple(sorted(values["minute"])),
        hours=tuple(sorted(values["hour"])),
        days=values["day-of-month"],
        months=values["month"],
        weekdays=values["day-of-week"],
        days_and_weekdays=(
            text["day-of-month"].startswith("*") or text["day-of-week"].startswith("*")
        ),
        hour_star=text["hour"].startswith("*"),
        has_seconds=len(texts) == 6,
    )


@lru_cache(maxsize=4096)
def _compile(expr: str) -> _Matcher:
    """Parse once per distinct expression: thousands of jobs share a few schedules."""
    try:
        _check_characters(expr)
        matcher = _build_matcher(_split_fields(expr))
        _check_can_fire(matcher)
    except _Invalid as exc:
        raise CronError(f"invalid cron expression {_show(expr)}: {exc}") from None
    return matcher


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
    as naive local datetimes. Measured cost of ``next_after`` (CPython 3.11, one
    core): ``*/5 * * * *`` about 18 us in Europe/Berlin and 6 us in UTC; a
    per-second schedule inside Berlin's repeated hour about 70 us.
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
        local = self._matcher.next_local(wall)
        if self._matcher.hour_star and local < fold.end:
            return local - fold.post
        return None

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
