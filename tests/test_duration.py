import pytest

from pgflow.duration import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400), ("45", 45), (12, 12), (1.5, 1.5),
     (" 5m ", 300), ("0.5s", 0.5)],
)
def test_parses_units_and_plain_seconds(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "abc", "10x", "-5s", "1h30m", True, None, [1], "inf", -1,
                                 float("nan"), "400d"])
def test_rejects_garbage_with_a_readable_reason(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(bad)
    assert "\n" not in str(info.value)


def test_format_round_trips() -> None:
    for seconds in (1, 90, 600, 7200, 86400, 0.5):
        assert parse_duration(format_duration(seconds)) == seconds
