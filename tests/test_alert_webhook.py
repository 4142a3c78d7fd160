"""Alert pieces without a database: job globs, bodies, Slack text, signatures, and the
asyncio HTTP client against raw sockets."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re

import pytest

from pgflow.alerts import webhook
from pgflow.alerts.definitions import AlertSpec, glob_regex


@pytest.mark.parametrize(("glob", "matches", "misses"), [
    ("extract_*", ["extract_orders", "extract_"], ["load_extract_x", "extract"]),
    ("job-?", ["job-1", "job-a"], ["job-10", "job"]),
    ("[ab]*.daily", ["a.daily", "bx.daily"], ["c.daily", "axdaily"]),
    ("[!x]y", ["ay"], ["xy"]),
])
def test_globs_become_anchored_regexes(glob: str, matches: list[str], misses: list[str]) -> None:
    pattern = re.compile(glob_regex(glob))
    assert all(pattern.match(name) for name in matches)
    assert not any(pattern.match(name) for name in misses)


@pytest.mark.parametrize("bad", ["extract_[abc", "a]b", "", "job name", "x" * 200])
def test_bad_globs_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        glob_regex(bad)


def test_definitions_default_to_every_event_and_need_one_url() -> None:
    spec = AlertSpec(name="a", url="https://example.com/h")
    assert "replica_lost" in spec.events and spec.format == "json"
    with pytest.raises(ValueError, match="exactly one of 'url' or 'url_env'"):
        AlertSpec(name="a", url="https://example.com/h", url_env="HOOK")
    with pytest.raises(ValueError, match="scheme must be http or https"):
        AlertSpec(name="a", url="file:///etc/passwd")


def test_the_json_body_leads_with_id_and_drops_empty_fields() -> None:
    raw = webhook.body("n-1", {"event": "run_failed", "status": "firing", "summary": "s",
                               "url": "http://ui/runs/3", "job": "j", "error": None}, "json")
    document = json.loads(raw)
    assert list(document)[:3] == ["id", "event", "status"] and "error" not in document


def test_slack_text_is_readable_and_links_to_the_ui() -> None:
    raw = webhook.body("n-1", {"event": "deadline_missed", "status": "resolved",
                               "summary": "run 3 succeeded", "url": "http://ui/runs/3",
                               "job": "load", "run_id": 3}, "slack")
    text = json.loads(raw)["text"]
    assert text.startswith(":white_check_mark: *[RESOLVED] deadline_missed*: run 3 succeeded")
    assert "job: load" in text and text.endswith("<http://ui/runs/3|Open in pgflow>")


def test_signature_is_the_hmac_of_the_raw_body() -> None:
    raw = b'{"id":"x"}'
    headers = webhook.headers("x", raw, "k")
    digest = hmac.new(b"k", raw, hashlib.sha256).hexdigest()
    assert headers["X-Pgflow-Signature"] == f"sha256={digest}"
    assert "X-Pgflow-Signature" not in webhook.headers("x", raw, None)


async def _serve_once(answer: bytes | None) -> tuple[asyncio.Server, str, list[bytes]]:
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.read(65536))
        if answer is None:
            await asyncio.sleep(60)  # never answers
        writer.write(answer or b"")
        await writer.drain()
        await asyncio.sleep(60)  # and keeps the connection open

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/in?x=1", got


def test_the_status_counts_even_when_the_receiver_keeps_the_connection_open() -> None:
    async def main() -> webhook.Answer:
        server, url, got = await _serve_once(b"HTTP/1.1 202 Accepted\r\nX: y\r\n\r\npartial")
        async with server:
            answer = await webhook.post(url, b"{}", {"Content-Type": "application/json"},
                                        timeout=30)
        assert got[0].startswith(b"POST /in?x=1 HTTP/1.1\r\n")
        return answer

    answer = asyncio.run(main())
    assert answer.ok and answer.status == 202 and answer.body == "partial"


def test_a_receiver_that_never_answers_times_out() -> None:
    async def main() -> webhook.Answer:
        server, url, _ = await _serve_once(None)
        async with server:
            return await webhook.post(url, b"{}", {}, timeout=0.5)

    answer = asyncio.run(main())
    assert not answer.ok and answer.error == "timed out after 0.5s"


def test_a_refused_connection_is_an_answer_not_an_exception() -> None:
    answer = asyncio.run(webhook.post("http://127.0.0.1:9/", b"{}", {}, timeout=5))
    assert answer.status is None and "Error" in (answer.error or "")
