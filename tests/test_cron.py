"""Cron parsing and fire times, including daylight-saving transitions. No database."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from pgflow.cron import CronError, CronSchedule, load_timezone, parse_cron
from pgflow.errors import PgflowError

BERLIN = ZoneInfo("Europe/Berlin")


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0,
        microsecond: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, second, microsecond, tzinfo=UTC)


def ticks(expr: str, tz: str, start: datetime, end: datetime) -> list[datetime]:
    return list(parse_cron(expr, tz).ticks_between(start, end))


def strictly_increasing(values: list[datetime]) -> bool:
    return all(a < b for a, b in pairwise(values))


# --- plain schedules -----------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        ("*/5 * * * *", utc(2025, 6, 1, 12, 3), utc(2025, 6, 1, 12, 5)),
        ("*/5 * * * *", utc(2025, 6, 1, 12, 5), utc(2025, 6, 1, 12, 10)),  # strictly after
        ("*/5 * * * *", utc(2025, 6, 1, 12, 4, 59, 999999), utc(2025, 6, 1, 12, 5)),
        ("0 9 * * 1-5", utc(2025, 6, 6, 9, 0), utc(2025, 6, 9, 9, 0)),  # Friday -> Monday
        ("0 0 1 * *", utc(2025, 12, 15), utc(2026, 1, 1)),
        ("15 10 * jan,JUL *", utc(2025, 2, 1), utc(2025, 7, 1, 10, 15)),
        ("0 12 * * 7", utc(2025, 6, 2), utc(2025, 6, 8, 12)),  # 7 is Sunday
        ("0 12 * * sun", utc(2025, 6, 2), utc(2025, 6, 8, 12)),
        ("30 23 31 * *", utc(2025, 4, 1), utc(2025, 5, 31, 23, 30)),  # April has no 31st
        ("0 0 29 2 *", utc(2025, 1, 1), utc(2028, 2, 29)),
        ("5/20 * * * *", utc(2025, 1, 1, 0, 6), utc(2025, 1, 1, 0, 25)),  # N/S is N-59/S
    ],
)
def test_five_field_next_times(expr: str, after: datetime, expected: datetime) -> None:
    assert parse_cron(expr).next_after(after) == expected


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        ("30 0 12 * * *", utc(2025, 1, 1), utc(2025, 1, 1, 12, 0, 30)),  # seconds come first
        ("*/10 * * * * *", utc(2025, 1, 1, 0, 0, 5), utc(2025, 1, 1, 0, 0, 10)),
        ("*/10 * * * * *", utc(2025, 1, 1, 0, 0, 50), utc(2025, 1, 1, 0, 1)),
        ("0 0 0 1 1 *", utc(2025, 1, 1), utc(2026, 1, 1)),
        ("59 59 23 * * *", utc(2025, 1, 1), utc(2025, 1, 1, 23, 59, 59)),
    ],
)
def test_six_field_next_times_with_seconds_first(
    expr: str, after: datetime, expected: datetime
) -> None:
    schedule = parse_cron(expr)
    assert schedule.has_seconds
    assert schedule.next_after(after) == expected


def test_results_are_utc_aware_whatever_the_input_zone() -> None:
    schedule = parse_cron("0 9 * * *", "Asia/Tokyo")
    result = schedule.next_after(datetime(2025, 6, 1, 8, 0, tzinfo=ZoneInfo("Asia/Tokyo")))
    assert result == utc(2025, 6, 1, 0, 0)
    assert result.tzinfo is UTC


def test_attributes_and_convenience_constructor() -> None:
    schedule = parse_cron("*/5 * * * *", "Europe/Berlin")
    assert isinstance(schedule, CronSchedule)
    assert (schedule.expr, schedule.timezone, schedule.has_seconds) == (
        "*/5 * * * *", "Europe/Berlin", False
    )
    assert CronSchedule("@daily").timezone == "UTC"


@pytest.mark.parametrize(
    ("alias", "expanded"),
    [
        ("@yearly", "0 0 1 1 *"),
        ("@annually", "0 0 1 1 *"),
        ("@monthly", "0 0 1 * *"),
        ("@weekly", "0 0 * * 0"),
        ("@daily", "0 0 * * *"),
        ("@midnight", "0 0 * * *"),
        ("@hourly", "0 * * * *"),
        ("@Daily", "0 0 * * *"),
    ],
)
def test_aliases_match_their_expansion(alias: str, expanded: str) -> None:
    start, end = utc(2024, 12, 1), utc(2027, 1, 1)
    assert ticks(alias, "Europe/Berlin", start, end) == ticks(expanded, "Europe/Berlin", start, end)


def test_hourly_alias_fires_at_both_repeated_hours() -> None:
    night = ticks("@hourly", "Europe/Berlin", utc(2025, 10, 26, 0), utc(2025, 10, 26, 2))
    assert night == [utc(2025, 10, 26, 0), utc(2025, 10, 26, 1)]


def test_day_fields_follow_vixie_cron() -> None:
    # Both restricted: either matches. One starting with '*': both must match.
    assert parse_cron("0 0 1 * 1").next_after(utc(2025, 1, 2)) == utc(2025, 1, 6)  # a Monday
    assert parse_cron("0 0 */2 * 1").next_after(utc(2025, 1, 1)) == utc(2025, 1, 13)


@pytest.mark.parametrize(
    ("expr", "second_at_beginning"),
    [
        ("*/7 * * * *", False),
        ("0 9-17/2 * * mon-fri", False),
        ("15,45 */3 1-10 * *", False),
        ("0 0 1,15 */2 *", False),
        ("0 12 1 * 1", False),
        ("0 4 */3 * 2", False),
        ("*/15 30 */6 * * *", True),
        ("0 0 12 * * 6", True),
    ],
)
def test_agrees_with_croniter_in_utc(expr: str, second_at_beginning: bool) -> None:
    # implement_cron_bug selects croniter's Vixie-compatible day-of-month/week rule.
    reference = croniter(
        expr, utc(2024, 2, 27), second_at_beginning=second_at_beginning, implement_cron_bug=True
    )
    expected = [reference.get_next(datetime) for _ in range(300)]
    schedule, current, got = parse_cron(expr), utc(2024, 2, 27), []
    for _ in range(300):
        current = schedule.next_after(current)
        got.append(current)
    assert got == expected


# --- ranges and look-back --------------------------------------------------------


def test_ticks_between_includes_start_and_excludes_end() -> None:
    got = ticks("0 * * * *", "UTC", utc(2025, 1, 1, 10), utc(2025, 1, 1, 13))
    assert got == [utc(2025, 1, 1, 10), utc(2025, 1, 1, 11), utc(2025, 1, 1, 12)]


def test_ticks_between_is_empty_for_an_empty_range() -> None:
    assert ticks("* * * * *", "UTC", utc(2025, 1, 1, 10), utc(2025, 1, 1, 10)) == []
    assert ticks("* * * * *", "UTC", utc(2025, 1, 1, 11), utc(2025, 1, 1, 10)) == []


def test_last_at_or_before() -> None:
    schedule = parse_cron("0 9 * * *", "America/New_York")
    assert schedule.last_at_or_before(utc(2025, 7, 2, 13)) == utc(2025, 7, 2, 13)  # inclusive
    assert schedule.last_at_or_before(utc(2025, 7, 2, 12, 59)) == utc(2025, 7, 1, 13)
    assert schedule.last_at_or_before(utc(2025, 1, 2, 15)) == utc(2025, 1, 2, 14)


def test_last_at_or_before_gives_up_after_the_look_back() -> None:
    leap_day = parse_cron("0 0 29 2 *")
    assert leap_day.last_at_or_before(utc(2024, 12, 31)) == utc(2024, 2, 29)
    assert leap_day.last_at_or_before(utc(2025, 6, 1)) is None  # 458 days back


def test_last_at_or_before_around_transitions() -> None:
    every_quarter = parse_cron("*/15 * * * *", "Europe/Berlin")
    assert every_quarter.last_at_or_before(utc(2025, 10, 26, 0, 50)) == utc(2025, 10, 26, 0, 45)
    assert every_quarter.last_at_or_before(utc(2025, 10, 26, 1, 20)) == utc(2025, 10, 26, 1, 15)
    fixed = parse_cron("30 2 * * *", "Europe/Berlin")
    assert fixed.last_at_or_before(utc(2025, 10, 26, 1, 45)) == utc(2025, 10, 26, 0, 30)
    assert fixed.last_at_or_before(utc(2025, 3, 30, 1)) == utc(2025, 3, 30, 1)  # the gap fire
    assert fixed.last_at_or_before(utc(2025, 3, 30, 0, 59)) == utc(2025, 3, 29, 1, 30)


def test_naive_datetimes_are_rejected() -> None:
    schedule = parse_cron("* * * * *")
    with pytest.raises(ValueError, match="timezone-aware"):
        schedule.next_after(datetime(2025, 1, 1))
    with pytest.raises(ValueError, match="timezone-aware"):
        list(schedule.ticks_between(datetime(2025, 1, 1), utc(2025, 1, 2)))
    with pytest.raises(ValueError, match="timezone-aware"):
        schedule.last_at_or_before(datetime(2025, 1, 1))


def test_running_off_the_calendar_is_a_cron_error() -> None:
    with pytest.raises(CronError, match="no fire time"):
        parse_cron("0 0 1 1 *", "Europe/Berlin").next_after(utc(9999, 6, 1))


# --- time zones and daylight saving ---------------------------------------------


def test_local_time_maps_to_utc_by_season() -> None:
    schedule = parse_cron("0 9 * * *", "America/New_York")
    assert schedule.next_after(utc(2025, 1, 15)) == utc(2025, 1, 15, 14)  # EST, UTC-5
    assert schedule.next_after(utc(2025, 7, 15)) == utc(2025, 7, 15, 13)  # EDT, UTC-4


@pytest.mark.parametrize(
    ("tz", "after", "fire"),
    [
        ("Europe/Berlin", utc(2025, 3, 29, 12), utc(2025, 3, 30, 1)),  # 03:00 CEST
        ("America/New_York", utc(2025, 3, 8, 12), utc(2025, 3, 9, 7)),  # 03:00 EDT
    ],
)
def test_skipped_time_fires_once_at_the_transition(
    tz: str, after: datetime, fire: datetime
) -> None:
    schedule = parse_cron("30 2 * * *", tz)
    assert schedule.next_after(after) == fire
    assert ticks("30 2 * * *", tz, after, after + timedelta(days=1)) == [fire]


def test_ticks_inside_a_gap_collapse_into_one() -> None:
    got = ticks("*/15 2 * * *", "Europe/Berlin", utc(2025, 3, 29, 12), utc(2025, 3, 30, 12))
    assert got == [utc(2025, 3, 30, 1)]
    day = ticks("*/15 * * * *", "Europe/Berlin",
                datetime(2025, 3, 30, tzinfo=BERLIN), datetime(2025, 3, 31, tzinfo=BERLIN))
    # 23 real hours; 02:00-02:45 collapse into the 03:00 tick.
    assert len(day) == 23 * 4
    assert strictly_increasing(day)


def test_repeated_time_with_fixed_hour_fires_once() -> None:
    day = ticks("30 2 * * *", "Europe/Berlin",
                datetime(2025, 10, 26, tzinfo=BERLIN), datetime(2025, 10, 27, tzinfo=BERLIN))
    assert day == [utc(2025, 10, 26, 0, 30)]  # 02:30 CEST, not again at 02:30 CET
    hours = ticks("0 1-3 * * *", "Europe/Berlin", utc(2025, 10, 25, 12), utc(2025, 10, 26, 12))
    assert hours == [utc(2025, 10, 25, 23), utc(2025, 10, 26, 0), utc(2025, 10, 26, 2)]


def test_repeated_time_with_wildcard_hour_fires_twice() -> None:
    night = ticks("30 * * * *", "Europe/Berlin", utc(2025, 10, 25, 23), utc(2025, 10, 26, 3))
    assert night == [utc(2025, 10, 25, 23, 30), utc(2025, 10, 26, 0, 30),
                     utc(2025, 10, 26, 1, 30), utc(2025, 10, 26, 2, 30)]
    assert parse_cron("30 * * * *", "Europe/Berlin").next_after(
        utc(2025, 10, 26, 0, 30)) == utc(2025, 10, 26, 1, 30)


def test_quarter_hours_across_fall_back_are_increasing_and_complete() -> None:
    day = ticks("*/15 * * * *", "Europe/Berlin",
                datetime(2025, 10, 26, tzinfo=BERLIN), datetime(2025, 10, 27, tzinfo=BERLIN))
    assert strictly_increasing(day)
    assert len(day) == 24 * 4 + 4  # the repeated 02:00-02:45 adds four ticks
    # Naive order would put 02:30 (repeat) before 02:45 (first); UTC order must not.
    assert utc(2025, 10, 26, 0, 45) in day and utc(2025, 10, 26, 1, 30) in day
    schedule = parse_cron("*/15 * * * *", "Europe/Berlin")
    assert schedule.next_after(utc(2025, 10, 26, 0, 30)) == utc(2025, 10, 26, 0, 45)
    assert schedule.next_after(utc(2025, 10, 26, 1, 30)) == utc(2025, 10, 26, 1, 45)


def test_seconds_schedule_across_transitions() -> None:
    every_20s = ticks("*/20 * * * * *", "Europe/Berlin", utc(2025, 10, 26, 0), utc(2025, 10, 26, 2))
    assert len(every_20s) == 2 * 3600 // 20  # both passes of 02:xx, gap-free in UTC
    assert strictly_increasing(every_20s)
    fixed_hour = ticks("0 */30 2 * * *", "Europe/Berlin",
                       utc(2025, 10, 25, 12), utc(2025, 10, 26, 12))
    assert fixed_hour == [utc(2025, 10, 26, 0), utc(2025, 10, 26, 0, 30)]
    spring = ticks("* * 2 * * *", "Europe/Berlin", utc(2025, 3, 29, 12), utc(2025, 3, 30, 12))
    assert spring == [utc(2025, 3, 30, 1)]


def test_lord_howe_half_hour_shift() -> None:
    tz = "Australia/Lord_Howe"  # +11 in summer, +10:30 in winter
    fall_back = ticks("30 * * * *", tz, utc(2025, 4, 5, 13), utc(2025, 4, 5, 17))
    assert fall_back == [utc(2025, 4, 5, 13, 30), utc(2025, 4, 5, 14, 30),  # 01:30 twice
                         utc(2025, 4, 5, 15, 0), utc(2025, 4, 5, 16, 0)]
    assert ticks("45 1 * * *", tz, utc(2025, 4, 5), utc(2025, 4, 6)) == [utc(2025, 4, 5, 14, 45)]
    spring = ticks("0 2 * * *", tz, utc(2025, 10, 3), utc(2025, 10, 6))
    # 2025-10-05 02:00-02:30 does not exist: that day fires at 02:30 (+11).
    assert spring == [utc(2025, 10, 3, 15, 30), utc(2025, 10, 4, 15, 30), utc(2025, 10, 5, 15)]


def test_a_whole_year_of_hours_in_berlin() -> None:
    year = ticks("0 * * * *", "Europe/Berlin",
                 datetime(2025, 1, 1, tzinfo=BERLIN), datetime(2026, 1, 1, tzinfo=BERLIN))
    # 365 * 24 = 8760 wall-clock hours. 2025-03-30 02:00 does not exist and merges
    # into the 03:00 fire (-1); 2025-10-26 02:00 happens twice and fires twice (+1).
    # Equivalently: the local year spans exactly 8760 real hours, one fire each.
    assert len(year) == 8760
    assert strictly_increasing(year)


def _transitions(tz: ZoneInfo, year: int) -> list[datetime]:
    hour = timedelta(hours=1)
    moment, found = utc(year, 1, 1), []
    while moment.year == year:
        if moment.astimezone(tz).utcoffset() != (moment + hour).astimezone(tz).utcoffset():
            found.append(moment)
        moment += hour
    return found


def _brute_force(
    tz: ZoneInfo, matches: Callable[[datetime], bool], both_passes: bool,
    start: datetime, end: datetime,
) -> list[datetime]:
    """Fire instants found by testing every UTC minute (a gap fires at its end)."""
    fires, moment, minute = [], start, timedelta(minutes=1)
    while moment < end:
        local = moment.astimezone(tz)
        wall = local.replace(tzinfo=None)
        before = (moment - minute).astimezone(tz)
        skipped = local.utcoffset() != before.utcoffset() and local.replace(
            tzinfo=None) - before.replace(tzinfo=None) > minute
        if skipped:
            gap_walls = before.replace(tzinfo=None) + minute
            while gap_walls < wall:
                if matches(gap_walls):
                    fires.append(moment)
                    break
                gap_walls += minute
        if matches(wall) and (local.fold == 0 or both_passes) and moment not in fires[-1:]:
            fires.append(moment)
        moment += minute
    return fires


ORACLE_CASES: list[tuple[str, Callable[[datetime], bool], bool]] = [
    ("30 2 * * *", lambda w: (w.hour, w.minute) == (2, 30), False),
    ("*/15 * * * *", lambda w: w.minute % 15 == 0, True),
    ("10,50 0-2 * * *", lambda w: w.minute in (10, 50) and w.hour <= 2, False),
    ("*/7 */2 * * *", lambda w: w.minute % 7 == 0 and w.hour % 2 == 0, True),
]


@pytest.mark.parametrize("zone", ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe",
                                  "Australia/Sydney", "America/Santiago", "Antarctica/Troll"])
def test_matches_a_brute_force_search_around_every_2025_transition(zone: str) -> None:
    tz = ZoneInfo(zone)
    for transition in _transitions(tz, 2025):
        start, end = transition - timedelta(hours=6), transition + timedelta(hours=6)
        for expr, matches, both_passes in ORACLE_CASES:
            expected = _brute_force(tz, matches, both_passes, start, end)
            assert ticks(expr, zone, start, end) == expected, (zone, transition, expr)


# --- hostile input ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("* * * *", "got 4"),
        ("* * * * * * *", "got 7"),
        ("61 * * * *", "minute field value 61 is out of range 0-59"),
        ("* 24 * * *", "hour field value 24 is out of range 0-23"),
        ("* * 0 * *", "day-of-month field value 0 is out of range 1-31"),
        ("* * * 13 *", "month field value 13 is out of range 1-12"),
        ("* * * * 8", "day-of-week field value 8 is out of range 0-7"),
        ("60 * * * * *", "second field value 60 is out of range 0-59"),
        ("*/0 * * * *", "step"),
        ("5-1 * * * *", "backwards"),
        ("1,,2 * * * *", "empty list item"),
        ("-5 * * * *", "not a number"),
        ("0 0 L * *", "not a number"),
        ("0 0 ? * *", "not a number"),
        ("0 0 * * 1#2", "not a number"),
        ("H * * * *", "not a number"),
        ("* * * * funday", "not a number or a day-of-week name"),
        ("0 0 30 2 *", "day 30 never occurs in month 2"),
        ("0 0 31 2,4 */2", "never occurs"),
        ("0 0 * * sat-sun", "Sunday is 0 or 7"),
        ("@reboot", "not supported"),
        ("@every 5m", "not supported"),
        ("'; DROP TABLE jobs; --", "minute field"),
        ("x" * 10_000, "10000 characters"),
        ("\x00", "control character"),
        ("* * * * *\n", "control character"),
        ("*\u00a0* * * *", "non-ASCII"),
        ("\u0661 * * * *", "non-ASCII"),  # an Arabic-Indic digit one
    ],
)
def test_bad_expressions_raise_a_one_line_cron_error(expr: str, reason: str) -> None:
    with pytest.raises(CronError) as info:
        parse_cron(expr)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300
    assert message.startswith("invalid cron expression ")
    assert reason in message


def test_out_of_range_message_names_expression_and_field() -> None:
    with pytest.raises(CronError) as info:
        parse_cron("61 * * * *")
    assert str(info.value) == (
        "invalid cron expression '61 * * * *': minute field value 61 is out of range 0-59"
    )


def test_non_string_expression_is_a_cron_error() -> None:
    with pytest.raises(CronError):
        parse_cron(None)  # type: ignore[arg-type]


def test_cron_error_is_a_pgflow_error_and_a_value_error() -> None:
    assert issubclass(CronError, PgflowError)
    assert issubclass(CronError, ValueError)  # so pydantic validators report it per field


@pytest.mark.parametrize(
    "name",
    ["Mars/Olympus", "", "../etc/passwd", "../../etc/passwd", "/etc/passwd", "UTC\n", "UTC\x00",
     "Europe/", "Europe", "right/Europe/Berlin", "localtime", "Europe/Berln", " UTC", "x" * 500],
)
def test_bad_timezones_raise_a_one_line_cron_error(name: str) -> None:
    with pytest.raises(CronError) as info:
        load_timezone(name)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("unknown timezone ")
    with pytest.raises(CronError):
        parse_cron("* * * * *", name)


def test_unknown_timezone_message() -> None:
    with pytest.raises(CronError) as info:
        load_timezone("Europe/Berln")
    assert str(info.value) == (
        "unknown timezone 'Europe/Berln' (use an IANA name such as Europe/Berlin)"
    )


@pytest.mark.parametrize("name", ["UTC", "Europe/Berlin", "America/Argentina/Buenos_Aires",
                                  "Etc/GMT+5", "America/Port-au-Prince"])
def test_good_timezones_load(name: str) -> None:
    assert load_timezone(name).key == name


# --- golden DST nights (expected instants worked out by hand) ---------------------
#
# Offsets: Berlin CET +1 / CEST +2, switching 2025-03-30 01:00 UTC (02:00 -> 03:00)
# and 2025-10-26 01:00 UTC (03:00 -> 02:00). New York EST -5 / EDT -4, switching
# 2025-03-09 07:00 UTC (02:00 -> 03:00) and 2025-11-02 06:00 UTC (02:00 -> 01:00).
# Lord Howe +10:30 / +11, switching 2025-04-05 15:00 UTC (02:00 -> 01:30) and
# 2025-10-04 15:30 UTC (02:00 -> 02:30). Apia went from 2011-12-29 23:59:59 -10 to
# 2011-12-31 00:00 +14 at 2011-12-30 10:00 UTC (local 2011-12-30 never happened),
# and fell back 2012-03-31 14:00 UTC (04:00 +14 -> 03:00 +13).

GOLDEN_NIGHTS: list[tuple[str, str, datetime, datetime, list[datetime]]] = [
    # Berlin, spring forward: 02:xx does not exist, so it fires at 03:00 CEST = 01:00 UTC.
    ("Europe/Berlin", "30 2 * * *", utc(2025, 3, 29, 12), utc(2025, 3, 31, 12),
     [utc(2025, 3, 30, 1), utc(2025, 3, 31, 0, 30)]),
    ("Europe/Berlin", "15 * * * *", utc(2025, 3, 29, 23), utc(2025, 3, 30, 3),
     [utc(2025, 3, 29, 23, 15), utc(2025, 3, 30, 0, 15), utc(2025, 3, 30, 1),
      utc(2025, 3, 30, 1, 15), utc(2025, 3, 30, 2, 15)]),
    ("Europe/Berlin", "0 */2 * * *", utc(2025, 3, 29, 22), utc(2025, 3, 30, 4),
     [utc(2025, 3, 29, 23), utc(2025, 3, 30, 1), utc(2025, 3, 30, 2)]),
    ("Europe/Berlin", "30 */20 * * * *", utc(2025, 3, 30, 0, 30), utc(2025, 3, 30, 1, 30),
     [utc(2025, 3, 30, 0, 40, 30), utc(2025, 3, 30, 1), utc(2025, 3, 30, 1, 0, 30),
      utc(2025, 3, 30, 1, 20, 30)]),
    # Berlin, fall back: 02:00-02:59 happens at 00:xx UTC (CEST) and again at 01:xx (CET).
    ("Europe/Berlin", "30 2 * * *", utc(2025, 10, 25, 12), utc(2025, 10, 27, 12),
     [utc(2025, 10, 26, 0, 30), utc(2025, 10, 27, 1, 30)]),
    ("Europe/Berlin", "15 * * * *", utc(2025, 10, 25, 23), utc(2025, 10, 26, 3),
     [utc(2025, 10, 25, 23, 15), utc(2025, 10, 26, 0, 15), utc(2025, 10, 26, 1, 15),
      utc(2025, 10, 26, 2, 15)]),
    ("Europe/Berlin", "0 */2 * * *", utc(2025, 10, 25, 21), utc(2025, 10, 26, 4),
     [utc(2025, 10, 25, 22), utc(2025, 10, 26, 0), utc(2025, 10, 26, 1), utc(2025, 10, 26, 3)]),
    ("Europe/Berlin", "10 0 2 * * *", utc(2025, 10, 25, 12), utc(2025, 10, 26, 12),
     [utc(2025, 10, 26, 0, 0, 10)]),
    ("Europe/Berlin", "20 30 * * * *", utc(2025, 10, 26, 0), utc(2025, 10, 26, 2),
     [utc(2025, 10, 26, 0, 30, 20), utc(2025, 10, 26, 1, 30, 20)]),
    # New York, spring forward: 02:xx does not exist, 03:00 EDT = 07:00 UTC.
    ("America/New_York", "30 2 * * *", utc(2025, 3, 8), utc(2025, 3, 10, 12),
     [utc(2025, 3, 8, 7, 30), utc(2025, 3, 9, 7), utc(2025, 3, 10, 6, 30)]),
    ("America/New_York", "0 * * * *", utc(2025, 3, 9, 5), utc(2025, 3, 9, 9),
     [utc(2025, 3, 9, 5), utc(2025, 3, 9, 6), utc(2025, 3, 9, 7), utc(2025, 3, 9, 8)]),
    ("America/New_York", "30 */2 * * *", utc(2025, 3, 9, 5), utc(2025, 3, 9, 11),
     [utc(2025, 3, 9, 5, 30), utc(2025, 3, 9, 7), utc(2025, 3, 9, 8, 30),
      utc(2025, 3, 9, 10, 30)]),
    ("America/New_York", "0 0 2 * * *", utc(2025, 3, 8, 12), utc(2025, 3, 9, 12),
     [utc(2025, 3, 9, 7)]),
    # New York, fall back: 01:00-01:59 happens at 05:xx UTC (EDT) and 06:xx UTC (EST).
    ("America/New_York", "30 1 * * *", utc(2025, 11, 1, 12), utc(2025, 11, 3, 12),
     [utc(2025, 11, 2, 5, 30), utc(2025, 11, 3, 6, 30)]),
    ("America/New_York", "0 0-3 * * *", utc(2025, 11, 2, 3), utc(2025, 11, 2, 9),
     [utc(2025, 11, 2, 4), utc(2025, 11, 2, 5), utc(2025, 11, 2, 7), utc(2025, 11, 2, 8)]),
    ("America/New_York", "30 * * * *", utc(2025, 11, 2, 4), utc(2025, 11, 2, 8),
     [utc(2025, 11, 2, 4, 30), utc(2025, 11, 2, 5, 30), utc(2025, 11, 2, 6, 30),
      utc(2025, 11, 2, 7, 30)]),
    ("America/New_York", "45 */1 * * *", utc(2025, 11, 2, 4), utc(2025, 11, 2, 8),
     [utc(2025, 11, 2, 4, 45), utc(2025, 11, 2, 5, 45), utc(2025, 11, 2, 6, 45),
      utc(2025, 11, 2, 7, 45)]),
    ("America/New_York", "30 15 1 * * *", utc(2025, 11, 1, 12), utc(2025, 11, 2, 12),
     [utc(2025, 11, 2, 5, 15, 30)]),
    ("America/New_York", "0 0 */1 * * *", utc(2025, 11, 2, 4), utc(2025, 11, 2, 8),
     [utc(2025, 11, 2, 4), utc(2025, 11, 2, 5), utc(2025, 11, 2, 6), utc(2025, 11, 2, 7)]),
    # Lord Howe, fall back by 30 minutes: 01:30-01:59 happens at 14:30 UTC (+11) and
    # again at 15:00 UTC (+10:30).
    ("Australia/Lord_Howe", "40 1 * * *", utc(2025, 4, 4), utc(2025, 4, 7),
     [utc(2025, 4, 4, 14, 40), utc(2025, 4, 5, 14, 40), utc(2025, 4, 6, 15, 10)]),
    ("Australia/Lord_Howe", "50 * * * *", utc(2025, 4, 5, 13), utc(2025, 4, 5, 17),
     [utc(2025, 4, 5, 13, 50), utc(2025, 4, 5, 14, 50), utc(2025, 4, 5, 15, 20),
      utc(2025, 4, 5, 16, 20)]),
    ("Australia/Lord_Howe", "35 */1 * * *", utc(2025, 4, 5, 13), utc(2025, 4, 5, 17),
     [utc(2025, 4, 5, 13, 35), utc(2025, 4, 5, 14, 35), utc(2025, 4, 5, 15, 5),
      utc(2025, 4, 5, 16, 5)]),
    ("Australia/Lord_Howe", "0 45 1 * * *", utc(2025, 4, 5), utc(2025, 4, 6),
     [utc(2025, 4, 5, 14, 45)]),
    ("Australia/Lord_Howe", "30 40 * * * *", utc(2025, 4, 5, 14), utc(2025, 4, 5, 16),
     [utc(2025, 4, 5, 14, 40, 30), utc(2025, 4, 5, 15, 10, 30)]),
    # Lord Howe, spring forward by 30 minutes: 02:00-02:29 does not exist, the clock
    # reads 02:30 (+11) at 15:30 UTC.
    ("Australia/Lord_Howe", "15 2 * * *", utc(2025, 10, 3), utc(2025, 10, 6),
     [utc(2025, 10, 3, 15, 45), utc(2025, 10, 4, 15, 30), utc(2025, 10, 5, 15, 15)]),
    ("Australia/Lord_Howe", "*/20 * * * *", utc(2025, 10, 4, 15), utc(2025, 10, 4, 16),
     [utc(2025, 10, 4, 15, 10), utc(2025, 10, 4, 15, 30), utc(2025, 10, 4, 15, 40)]),
    ("Australia/Lord_Howe", "10 */2 * * *", utc(2025, 10, 4, 13), utc(2025, 10, 4, 18),
     [utc(2025, 10, 4, 13, 40), utc(2025, 10, 4, 15, 30), utc(2025, 10, 4, 17, 10)]),
    ("Australia/Lord_Howe", "30 10 2 * * *", utc(2025, 10, 4), utc(2025, 10, 5),
     [utc(2025, 10, 4, 15, 30)]),
    # Apia skipped 2011-12-30: every tick of that local day collapses into one fire at
    # 10:00 UTC, which is also 2011-12-31 00:00 +14.
    ("Pacific/Apia", "0 12 * * *", utc(2011, 12, 29), utc(2011, 12, 31, 12),
     [utc(2011, 12, 29, 22), utc(2011, 12, 30, 10), utc(2011, 12, 30, 22)]),
    ("Pacific/Apia", "0 * * * *", utc(2011, 12, 30, 8), utc(2011, 12, 30, 12),
     [utc(2011, 12, 30, 8), utc(2011, 12, 30, 9), utc(2011, 12, 30, 10), utc(2011, 12, 30, 11)]),
    ("Pacific/Apia", "0 */6 * * *", utc(2011, 12, 29, 12), utc(2011, 12, 31),
     [utc(2011, 12, 29, 16), utc(2011, 12, 29, 22), utc(2011, 12, 30, 4), utc(2011, 12, 30, 10),
      utc(2011, 12, 30, 16), utc(2011, 12, 30, 22)]),
    ("Pacific/Apia", "30 15 10 * * *", utc(2011, 12, 29, 12), utc(2011, 12, 31, 12),
     [utc(2011, 12, 29, 20, 15, 30), utc(2011, 12, 30, 10), utc(2011, 12, 30, 20, 15, 30)]),
    # Apia, fall back: 03:00-03:59 happens at 13:xx UTC (+14) and at 14:xx UTC (+13).
    ("Pacific/Apia", "30 3 * * *", utc(2012, 3, 31), utc(2012, 4, 2),
     [utc(2012, 3, 31, 13, 30), utc(2012, 4, 1, 14, 30)]),
    ("Pacific/Apia", "30 * * * *", utc(2012, 3, 31, 12), utc(2012, 3, 31, 15),
     [utc(2012, 3, 31, 12, 30), utc(2012, 3, 31, 13, 30), utc(2012, 3, 31, 14, 30)]),
]


@pytest.mark.parametrize(("zone", "expr", "start", "end", "expected"), GOLDEN_NIGHTS)
def test_golden_dst_nights(
    zone: str, expr: str, start: datetime, end: datetime, expected: list[datetime]
) -> None:
    assert ticks(expr, zone, start, end) == expected
    schedule = parse_cron(expr, zone)
    for before, fire in pairwise([start - timedelta(microseconds=1), *expected]):
        assert schedule.next_after(before) == fire
    for fire, after in pairwise([*expected, end]):
        assert schedule.last_at_or_before(fire) == fire
        assert schedule.last_at_or_before(after - timedelta(microseconds=1)) == fire


def test_a_day_that_never_happened_fires_at_the_jump() -> None:
    dec_30 = parse_cron("0 9 30 12 *", "Pacific/Apia")
    assert dec_30.next_after(utc(2011, 12, 1)) == utc(2011, 12, 30, 10)
    assert dec_30.next_after(utc(2011, 12, 30, 10)) == utc(2012, 12, 29, 19)  # 09:00 +14
    assert dec_30.last_at_or_before(utc(2012, 6, 1)) == utc(2011, 12, 30, 10)


def test_fall_back_fires_once_where_croniter_alone_does_not() -> None:
    # Left to its own zone handling croniter does not follow the contract here (7.x
    # fires 02:30 CEST and 02:30 CET); pgflow hands it wall-clock times only.
    night = (datetime(2025, 10, 25, 12, tzinfo=BERLIN), datetime(2025, 10, 27, 12, tzinfo=BERLIN))
    alone = croniter("30 2 * * *", night[0], ret_type=datetime)
    by_croniter = [alone.get_next(datetime) for _ in range(2)]
    ours = ticks("30 2 * * *", "Europe/Berlin", *night)
    assert ours == [utc(2025, 10, 26, 0, 30), utc(2025, 10, 27, 1, 30)]
    assert [moment.astimezone(UTC) for moment in by_croniter] != ours


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        ("5-5 * * * *", utc(2025, 1, 1), utc(2025, 1, 1, 0, 5)),  # croniter: whole cycle
        ("59/15 * * * *", utc(2025, 1, 1), utc(2025, 1, 1, 0, 59)),  # N/S is N-59/S
        ("0 0 * * 7/2", utc(2025, 1, 1), utc(2025, 1, 5)),  # only Sunday
        ("0 0 * * 5-7", utc(2025, 1, 4, 1), utc(2025, 1, 5)),  # Fri, Sat, Sun
        ("0 0 1,* * 3", utc(2025, 1, 1), utc(2025, 1, 2)),  # no leading '*': OR, every day
        ("0 0 1-31 * 3,*/3", utc(2025, 1, 1), utc(2025, 1, 2)),  # OR as well
        ("0 0 *,1 * 3", utc(2025, 1, 1), utc(2025, 1, 8)),  # leading '*': AND, Wednesdays
        ("0 0 29 2 mon", utc(2025, 1, 1), utc(2025, 2, 3)),  # OR: Mondays in February
        ("0 0 1 JAN-Jan *", utc(2025, 6, 1), utc(2026, 1, 1)),
        ("  0 12 * * *\t", utc(2025, 1, 1), utc(2025, 1, 1, 12)),
        ("@midnight", utc(2025, 1, 1, 0, 0, 1), utc(2025, 1, 2)),
        ("0 0 29 2 */7", utc(2025, 1, 1), utc(2032, 2, 29)),  # a Sunday Feb 29
    ],
)
def test_forms_croniter_reads_differently_keep_their_meaning(
    expr: str, after: datetime, expected: datetime
) -> None:
    assert parse_cron(expr).next_after(after) == expected


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        # A trailing year is read as seconds-first and fails on the day of the week.
        ("0 0 * * 1-5 2025", "day-of-week field value 2025 is out of range 0-7"),
        ("0 0 1 1 * 2025 *", "got 7"),
        ("0 0 15W * *", "day-of-month field: '15W' is not a number"),
        ("0 0 * * L5", "day-of-week field: 'L5' is not a number or a day-of-week name"),
        ("H(0-29) * * * *", "minute field"),
        ("R * * * *", "minute field"),
        ("0 0 * 12-1 *", "month field: range '12-1' runs backwards"),
        ("0 0 * * mon-sun", "Sunday is 0 or 7"),
        ("*/61 * * * *", "minute field: step '61' must be a number from 1 to 60"),
        ("0 0 * * */8", "step '8' must be a number from 1 to 7"),
        ("0 0 31 4,6 *", "day 31 never occurs in month 4,6"),
        ("0 0 31 2-6/2 *", "day 31 never occurs in month 2,4,6"),
        ("0 0 30 feb */2", "never occurs"),
    ],
)
def test_croniter_extensions_and_impossible_days_are_refused(expr: str, reason: str) -> None:
    with pytest.raises(CronError) as info:
        parse_cron(expr)
    assert str(info.value).startswith("invalid cron expression ")
    assert reason in str(info.value)


def test_a_start_with_microseconds_does_not_skip_the_first_repeated_tick() -> None:
    # The scheduler's "now" has microseconds. From 02:30 CEST (first pass) the next
    # hourly tick is 02:00 CET (the repeat) at 01:00 UTC, not 03:00 CET at 02:00 UTC.
    hourly = parse_cron("0 * * * *", "Europe/Berlin")
    assert hourly.next_after(utc(2025, 10, 26, 0, 30, 0, 1)) == utc(2025, 10, 26, 1)
    apia = parse_cron("0 * * * *", "Pacific/Apia")  # 03:00-03:59 repeated, -10 then -11
    assert apia.next_after(utc(2011, 4, 2, 13, 30, 0, 1)) == utc(2011, 4, 2, 14)
    assert apia.last_at_or_before(utc(2011, 4, 2, 14, 30, 0, 1)) == utc(2011, 4, 2, 14)
