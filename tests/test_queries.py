import pytest

from pgflow.queries import expand, q, split

TEXT = """
-- fragment: tail
SELECT 1 FROM picked

-- name: first
WITH picked AS (SELECT 1)
-- include: tail

-- name: second
SELECT 2
"""


def test_statements_and_fragments_are_split_and_included() -> None:
    statements, fragments = split(TEXT)
    assert set(statements) == {"first", "second"} and fragments == {"tail": "SELECT 1 FROM picked"}
    expanded = expand(statements["first"], fragments)
    assert expanded == "WITH picked AS (SELECT 1)\nSELECT 1 FROM picked"


def test_an_unknown_fragment_is_an_error() -> None:
    with pytest.raises(ValueError, match="no fragment named 'nope'"):
        expand("SELECT 1\n-- include: nope", {})


def test_every_claim_ends_with_the_one_claim_step() -> None:
    for name in ("claim_runs", "claim_capped_runs", "claim_probe"):
        text = q(name)
        assert "-- include:" not in text
        assert text.count("claimed AS (") == 1 and text.rstrip().endswith("j.name = c.job")
