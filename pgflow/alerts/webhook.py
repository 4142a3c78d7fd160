"""What a receiver gets (SPEC §4d) and a small asyncio HTTP/1.1 client to send it.

pgflow has no HTTP client dependency, and a webhook needs little: one POST with a
body, a per-request timeout, the status code back. ``post`` speaks HTTP/1.1 over
``asyncio.open_connection`` (TLS with the system's default verification for https),
sends ``Connection: close`` and reads at most ``MAX_ANSWER`` bytes of the answer,
so a hanging or chatty receiver costs one task and one socket until the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

TIMEOUT_S = 10.0
MAX_ANSWER = 64 * 1024
BODY_WAIT_S = 2.0
USER_AGENT = "pgflow-alerts/1"
SIGNATURE_HEADER = "X-Pgflow-Signature"
_FIELDS = ("id", "event", "status", "at", "summary", "url", "job", "tenant", "run_id",
           "logical_time", "attempt", "error", "source")


@dataclass(frozen=True)
class Answer:
    """What the receiver answered: a status code, or an error (timeout, refused, ...)."""

    status: int | None
    error: str | None
    body: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def describe(self) -> str:
        if self.status is not None:
            return f"HTTP {self.status}" + (f": {self.body[:200]}" if self.body and not self.ok
                                             else "")
        return self.error or "no answer"


def body(notification_id: str, payload: dict[str, Any], fmt: str) -> bytes:
    """The raw request body: the §4d object (``json``) or ``{"text": ...}`` (``slack``)."""
    document = {"id": notification_id, **payload}
    ordered = {k: document[k] for k in _FIELDS if document.get(k) is not None}
    ordered.update({k: v for k, v in document.items() if k not in ordered and v is not None})
    if fmt == "slack":
        return json.dumps({"text": slack_text(ordered)}, ensure_ascii=False).encode()
    return json.dumps(ordered, ensure_ascii=False, separators=(",", ":")).encode()


def slack_text(doc: dict[str, Any]) -> str:
    icon = ":rotating_light:" if doc.get("status") == "firing" else ":white_check_mark:"
    state = "FIRING" if doc.get("status") == "firing" else "RESOLVED"
    lines = [f"{icon} *[{state}] {doc.get('event')}*: {doc.get('summary', '')}"]
    facts = [f"{k}: {doc[k]}" for k in ("job", "tenant", "run_id", "logical_time", "attempt",
                                        "source") if doc.get(k) is not None]
    if facts:
        lines.append(" · ".join(facts))
    if doc.get("error"):
        lines.append(f"```{str(doc['error'])[:1500]}```")
    if doc.get("url"):
        lines.append(f"<{doc['url']}|Open in pgflow>")
    return "\n".join(lines)


def signature(secret: str, raw: bytes) -> str:
    """``sha256=<hex HMAC-SHA256 of the raw body>``."""
    return "sha256=" + hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest()


def headers(notification_id: str, raw: bytes, secret: str | None) -> dict[str, str]:
    found = {"Content-Type": "application/json", "User-Agent": USER_AGENT,
             "X-Pgflow-Notification": notification_id}
    if secret:
        found[SIGNATURE_HEADER] = signature(secret, raw)
    return found


async def post(url: str, raw: bytes, extra: dict[str, str],
               timeout: float = TIMEOUT_S) -> Answer:
    """POST ``raw`` to ``url``; never raises for network problems (they are the Answer)."""
    try:
        return await asyncio.wait_for(_post(url, raw, extra), timeout)
    except TimeoutError:
        return Answer(None, f"timed out after {timeout:g}s")
    except (OSError, ssl.SSLError, ValueError, asyncio.IncompleteReadError) as exc:
        return Answer(None, f"{type(exc).__name__}: {exc}"[:500])


async def _post(url: str, raw: bytes, extra: dict[str, str]) -> Answer:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("the URL must be http(s)://host/...")
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    port = parts.port or (443 if tls else 80)
    reader, writer = await asyncio.open_connection(
        parts.hostname, port, ssl=tls, server_hostname=parts.hostname if tls else None)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        lines = [f"POST {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(raw)}",
                 "Connection: close", *(f"{k}: {v}" for k, v in extra.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + raw)
        await writer.drain()
        status_line = await reader.readline()
        fields = status_line.decode("latin-1").split(" ", 2)
        if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
            return Answer(None, f"not an HTTP answer: {status_line[:80]!r}")
        length = None
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length" and value.strip().isdigit():
                length = int(value.strip())
        want = MAX_ANSWER if length is None else min(length, MAX_ANSWER)
        answer = b""
        # The status is the answer; the body is only shown to operators, so a receiver
        # that keeps the connection open after its headers does not turn it into a timeout.
        with contextlib.suppress(TimeoutError):
            answer = await asyncio.wait_for(reader.read(want), BODY_WAIT_S) if want else b""
        return Answer(int(fields[1]), None, answer.decode("utf-8", errors="replace"))
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
