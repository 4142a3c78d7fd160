"""Property: pgflow's cron fire times equal a brute-force scan of the UTC line.

The reference below knows nothing of croniter or of pgflow.cron's internals. It
builds each random expression from structured fields, so it knows the values each
field allows, and walks UTC minute by minute: for each instant it reads the local
wall clock with zoneinfo (fold included) and applies the contract (SPEC §3)
directly:

* a wall time that matches fires, except on its repeat (fold=1) after a fall-back
  unless the hour field starts with ``*``;
* an instant right after a forward jump fires if any skipped wall time matches.

Every zone here changes its offset on whole minutes only, and a skipped or repeated
stretch always spans whole minutes, so one look per minute decides the minute; for
six-field expressions the seconds inside a matching minute are then enumerated.
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgflow.cron import parse_cron

ONE_MINUTE = timedelta(minutes=1)
WINDOW = timedelta(hours=26)  # search this far; rarer expressions must fire beyond it
ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Pacific/Apia", "UTC"]
YEARS = (2011, 2012, 2025)


@dataclass(frozen=True)
class Spec:
    name: str
    low: int
    high: int  # largest value a number may take (day-of-week: 7, Sunday again)
    star_high: int  # where '*' and 'N/S' stop
    names: tuple[str, ...] = ()  # spelling of low, low + 1, ...
    favourites: tuple[int, ...] = ()  # values drawn more often (the hours DST moves)


SECOND = Spec("second", 0, 59, 59)
MINUTE = Spec("minute", 0, 59, 59)
HOUR = Spec("hour", 0, 23, 23, favourites=(1, 2, 3))
DAY = Spec("day", 1, 31, 31)
MONTH = Spec("month", 1, 12, 12, tuple(m.lower() for m in calendar.month_abbr[1:]))
WEEKDAY = Spec("weekday", 0, 7, 6, ("sun", "mon", "tue", "wed", "thu", "fri", "sat"))


@dataclass(frozen=True)
class Field:
    text: str
    values: frozenset[int]


@dataclass(frozen=True)
class Expression:
    text: str
    second: frozenset[int] | None  # None: five fields (second 0)
    minute: frozenset[int]
    hour: frozenset[int]
    day: frozenset[int]
    month: frozenset[int]
    weekday: frozenset[int]  # 0 = Sunday
    days_or: bool  # neither day field starts with '*'
    hour_star: bool

    def matches_minute(self, wall: datetime) -> bool:
        if wall.minute not in self.minute or wall.hour not in self.hour:
            return False
        if wall.month not in self.month:
            return False
        day_ok = wall.day in self.day
        weekday_ok = (wall.weekday() + 1) % 7 in self.weekday
        return (day_ok or weekday_ok) if self.days_or else (day_ok and weekday_ok)

    def seconds(self) -> list[int]:
        return [0] if self.second is None else sorted(self.second)


# --- random expressions ----------------------------------------------------------


def spell(value: int, spec: Spec, use_name: bool) -> str:
    if use_name and spec.names and value - spec.low < len(spec.names):
        name = spec.names[value - spec.low]
        return name.upper() if value % 2 else name
    return str(value)


@st.composite
def items(draw: st.DrawFn, spec: Spec) -> tuple[str, set[int]]:
    kind = draw(st.sampled_from(["*", "*/", "n", "n/", "a-b", "a-b/"]))
    limit = spec.star_high - spec.low + 1
    step = draw(st.integers(1, min(limit, 12)))
    if kind == "*":
        return "*", set(range(spec.low, spec.star_high + 1))
    if kind == "*/":
        return f"*/{step}", set(range(spec.low, spec.star_high + 1, step))
    favourite = bool(spec.favourites) and draw(st.booleans())
    first = (draw(st.sampled_from(spec.favourites)) if favourite
             else draw(st.integers(spec.low, spec.high)))
    named = draw(st.booleans())
    if kind == "n":
        return spell(first, spec, named), {first}
    if kind == "n/":  # N/S is N-max/S
        return f"{spell(first, spec, named)}/{step}", set(
            range(first, max(first, spec.star_high) + 1, step))
    last = draw(st.integers(first, spec.high))
    text = f"{spell(first, spec, named)}-{spell(last, spec, named)}"
    if kind == "a-b":
        return text, set(range(first, last + 1))
    return f"{text}/{step}", set(range(first, last + 1, step))


@st.composite
def fields(draw: st.DrawFn, spec: Spec, star_odds: int) -> Field:
    """A field; ``star_odds`` in 10 that it is just ``*`` (keeps expressions frequent)."""
    if draw(st.integers(0, 9)) < star_odds:
        return Field("*", frozenset(range(spec.low, spec.star_high + 1)))
    parts = draw(st.lists(items(spec), min_size=1, max_size=3))
    values = set().union(*(part[1] for part in parts))
    if spec is WEEKDAY and 7 in values:
        values = (values - {7}) | {0}
    return Field(",".join(part[0] for part in parts), frozenset(values))


@st.composite
def expressions(draw: st.DrawFn, any_day: bool = False) -> Expression:
    """A random expression; ``any_day``: every day matches (to aim at DST nights)."""
    six = draw(st.booleans())
    second = draw(fields(SECOND, 3)) if six else None
    minute, hour = draw(fields(MINUTE, 2)), draw(fields(HOUR, 2))
    day, month, weekday = (draw(fields(spec, 10 if any_day else odds))
                           for spec, odds in ((DAY, 6), (MONTH, 8), (WEEKDAY, 6)))
    texts = [f.text for f in (second, minute, hour, day, month, weekday) if f is not None]
    return Expression(
        text=" ".join(texts),
        second=None if second is None else second.values,
        minute=minute.values, hour=hour.values, day=day.values, month=month.values,
        weekday=weekday.values,
        days_or=not (day.text.startswith("*") or weekday.text.startswith("*")),
        hour_star=hour.text.startswith("*"),
    )


def can_fire(expr: Expression) -> bool:
    """Whether some real date matches (pgflow refuses e.g. ``0 0 30 2 *``)."""
    if expr.days_or:
        return True
    longest = {month: calendar.monthrange(2024, month)[1] for month in expr.month}
    return any(day <= longest[month] for day in expr.day for month in expr.month)


def transitions(zone: str) -> list[datetime]:
    """The instants at which ``zone`` changes its UTC offset in YEARS."""
    tz, found = ZoneInfo(zone), []

    def offset(moment: datetime) -> timedelta | None:
        return moment.astimezone(tz).utcoffset()

    for year in YEARS:
        moment = datetime(year, 1, 1, tzinfo=UTC)
        while moment.year == year:
            if offset(moment) != offset(moment + ONE_MINUTE * 30):
                change = moment + ONE_MINUTE
                while offset(change) == offset(moment):
                    change += ONE_MINUTE
                # On a whole minute, as the reference assumes (see the docstring).
                assert offset(change - timedelta(seconds=1)) == offset(moment)
                found.append(change)
            moment += ONE_MINUTE * 30
    return found


TRANSITIONS = {zone: transitions(zone) for zone in ZONES}


@st.composite
def instants(draw: st.DrawFn, zone: str, near: bool = False) -> datetime:
    """A random instant, mostly near a transition; ``near``: within 90 minutes of one."""
    odds = 0 if near else draw(st.integers(0, 19))
    if TRANSITIONS[zone] and odds < 17:
        base = draw(st.sampled_from(TRANSITIONS[zone]))
        reach = 90 * 60 if odds < 14 else 30 * 3600
        moment = base + timedelta(seconds=draw(st.integers(-reach, reach)))
    else:
        year = draw(st.sampled_from(YEARS))
        moment = datetime(year, 1, 1, tzinfo=UTC) + timedelta(
            seconds=draw(st.integers(0, 364 * 86400)))
    return moment + timedelta(microseconds=draw(st.sampled_from([0, 0, 1, 999_999])))


# --- the reference ---------------------------------------------------------------


def fires_in_minute(expr: Expression, tz: ZoneInfo, minute: datetime) -> list[datetime]:
    """The fire instants in [minute, minute + 1 min), by the contract's rules."""
    local = minute.astimezone(tz)
    wall = local.replace(tzinfo=None)
    found: set[datetime] = set()
    if expr.matches_minute(wall) and (local.fold == 0 or expr.hour_star):
        found.update(minute + timedelta(seconds=s) for s in expr.seconds())
    previous_wall = (minute - ONE_MINUTE).astimezone(tz).replace(tzinfo=None)
    skipped = previous_wall + ONE_MINUTE
    while skipped < wall:  # wall-clock minutes a forward jump skipped
        if expr.matches_minute(skipped):
            found.add(minute)  # fires once, at the first instant after the gap
            break
        skipped += ONE_MINUTE
    return sorted(found)


def reference_next(expr: Expression, tz: ZoneInfo, after: datetime) -> datetime | None:
    minute = after.replace(second=0, microsecond=0)
    while minute <= after + WINDOW:
        for fire in fires_in_minute(expr, tz, minute):
            if fire > after:
                return fire
        minute += ONE_MINUTE
    return None


def reference_last(expr: Expression, tz: ZoneInfo, moment: datetime) -> datetime | None:
    minute = moment.replace(second=0, microsecond=0)
    while minute + ONE_MINUTE > moment - WINDOW:
        earlier = [fire for fire in fires_in_minute(expr, tz, minute)
                   if moment - WINDOW <= fire <= moment]
        if earlier:
            return earlier[-1]
        minute -= ONE_MINUTE
    return None


# --- the properties --------------------------------------------------------------


Case = tuple[Expression, str, datetime]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Any expression, zone and instant."""
    expr = draw(expressions().filter(can_fire))
    zone = draw(st.sampled_from(ZONES))
    return expr, zone, draw(instants(zone))


@st.composite
def dst_cases(draw: st.DrawFn) -> Case:
    """Daily expressions at most 90 minutes from a gap or a repeat."""
    zone = draw(st.sampled_from([zone for zone in ZONES if TRANSITIONS[zone]]))
    return draw(expressions(any_day=True)), zone, draw(instants(zone, near=True))


PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@PROPERTY_SETTINGS
@given(st.one_of(cases(), dst_cases()))
def test_next_after_matches_a_brute_force_scan(case: Case) -> None:
    expr, zone, after = case
    got = parse_cron(expr.text, zone).next_after(after)
    expected = reference_next(expr, ZoneInfo(zone), after)
    if expected is None:
        assert got > after + WINDOW, (expr.text, zone, after, got)
    else:
        assert got == expected, (expr.text, zone, after)


@PROPERTY_SETTINGS
@given(st.one_of(cases(), dst_cases()))
def test_last_at_or_before_matches_a_brute_force_scan(case: Case) -> None:
    expr, zone, moment = case
    got = parse_cron(expr.text, zone).last_at_or_before(moment)
    expected = reference_last(expr, ZoneInfo(zone), moment)
    if expected is None:
        assert got is None or got < moment - WINDOW, (expr.text, zone, moment, got)
    else:
        assert got == expected, (expr.text, zone, moment)
