import pytest

from pgflow.queries import CACHED_TEXT_MAX, _all, compact, expand, q, split

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


def test_a_fragment_that_includes_another_is_an_error() -> None:
    """Fragments are expanded once, into statements: an include inside one would be
    sent as a comment, its SQL silently missing."""
    with pytest.raises(ValueError, match="fragment 'outer' includes another fragment"):
        expand("SELECT 1\n-- include: outer", {"outer": "WHERE true\n-- include: inner",
                                               "inner": "AND true"})


def test_every_claim_ends_with_the_one_claim_step() -> None:
    for name in ("claim_runs", "claim_capped_runs", "claim_probe"):
        text = q(name)
        assert "-- include:" not in text
        assert text.count("claimed AS (") == 1 and text.rstrip().endswith("j.name = c.job")


def test_a_statement_is_sent_without_comments_but_its_first_line() -> None:
    text = compact("-- Names it\n  SELECT '--kept' AS a,  -- gone\n\n  -- gone too\n"
                   "  'a\n  -- inside a literal\n\n' AS b -- gone\n  FROM t")
    assert text == ("-- Names it\nSELECT '--kept' AS a,\n'a\n  -- inside a literal\n\n'"
                    " AS b\nFROM t")


def test_every_statement_fits_psycopgs_cache_of_parsed_texts() -> None:
    # Longer texts have their placeholders parsed again on every execute (0.2 ms a
    # claim): the hot statements must stay under it.
    import psycopg._queries

    assert CACHED_TEXT_MAX == psycopg._queries.MAX_CACHED_STATEMENT_LENGTH
    too_long = {name: len(q(name)) for name in _all() if len(q(name)) > CACHED_TEXT_MAX}
    assert not too_long
