"""Long runs: live output, progress and checkpoints of running attempts (SPEC §4e).

Design note
===========
What an attempt reports while it runs lives in its ``LiveOutput`` on the worker's
event loop: the output bytes not written yet, the latest progress and the latest
checkpoint. A command's stdout and stderr reach it through the pipes the replica
already reads (``pgflow.supervisor``); its control lines (``PGFLOW_CONTROL``) through
a third pipe, the command's fd 3, named ``/dev/fd/3`` (descendants inherit it unless
they close it; Python's ``subprocess`` needs ``pass_fds=(3,)``). A Python job calls
``ctx.progress`` / ``ctx.checkpoint``. Nothing a job does waits for the database:
writes only append to memory, and the replica drains the pipes as fast as it reads
stdout today (a frozen replica drains nothing: the job then blocks on a full pipe,
stdout's or the control pipe's alike, until the supervisor kills it at its lease
deadline).

Cost. A command attempt gets one more pipe and a ``LiveOutput`` (~10 µs, under 1 %
of its ~1.4 ms of CPU); a Python job gets a ``LiveOutput`` only at its first
``ctx.progress``/``ctx.checkpoint`` (a no-op run pays nothing). Attempts that report
nothing add nothing to any statement.

Flushes. One ``Flusher`` per worker writes every attempt's news in ONE statement
(``live_flush``) every ``FLUSH_S`` seconds, on its own connection (opened at the
first flush that has something to write). The statement only writes for attempts
the worker still holds (run, attempt, lease owner, state running, share-locked for
the statement), so a fenced worker's late chunks, progress and checkpoints are
dropped like its result. Progress is kept as the latest value only: a job
reporting 10,000 times a second costs one assignment per report and one column
update per flush. When an attempt ends, its remaining news is flushed (and waited
for, bounded) before its result is queued for ``finish_attempts``, so the final
checkpoint is stored before the next attempt can be claimed.

Durability window. A checkpoint is stored at the first flush after it was
reported (at most ``FLUSH_S`` plus one round trip later) and at the latest before
the attempt's result. A replica killed inside that window loses that checkpoint:
the next attempt starts from the previous one. A job that must not redo work after
a checkpoint makes each step idempotent (the README shows the pattern).

Output. Offsets are byte positions in the attempt's combined output (stdout,
stderr and pgflow's own ``[pgflow]`` notes, in arrival order). The first half of
``PGFLOW_LOG_LIMIT`` is kept as produced; beyond it only the newest half is kept:
older bytes are dropped from memory before they are written, and rows that fell
out of that window are deleted by the same flush statement. Readers show the gap
as a marker. Short commands that never lived through a flush and printed less
than the 64 KiB tails write no chunks at all (``stdout_tail``/``stderr_tail`` hold
all of it), so command fan-out pays nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
import psycopg.rows

from pgflow.queries import q

FLUSH_S = 2.0
DEFAULT_LOG_LIMIT = 16 * 1024 * 1024
MIN_LOG_LIMIT = 64 * 1024
MAX_CHECKPOINT = 1024 * 1024
MAX_MESSAGE = 1000
TAIL_BYTES = 64 * 1024  # what stdout_tail/stderr_tail keep (pgflow.executor)
CHUNK_MAX = 256 * 1024  # bytes per stored row
FLUSH_MAX_BYTES = 8 * 1024 * 1024  # output per flush statement; the rest waits a turn
MAX_CONTROL_LINE = MAX_CHECKPOINT + 64 * 1024
MAX_NOTES = 20  # [pgflow] warnings per attempt
READ_CHUNKS = 64
CONTROL_PATH = "/dev/fd/3"

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(value: object) -> int:
    """``16MiB``, ``512k``, ``1048576`` → bytes (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"expected a size such as 16MiB or 512KiB, got {value!r}")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _UNITS[unit]


def encode_checkpoint(value: Any) -> str:
    """The JSON text stored for ``value``; ValueError when it is not storable JSON or
    larger than ``MAX_CHECKPOINT``."""
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint is not JSON: {exc}") from None
    if "\\u0000" in text:
        raise ValueError("checkpoint contains a NUL character (\\u0000), which PostgreSQL"
                         " cannot store in jsonb")
    if len(text.encode()) > MAX_CHECKPOINT:
        raise ValueError(f"checkpoint is {len(text.encode()):,} bytes of JSON; at most"
                         f" {MAX_CHECKPOINT:,} are stored")
    return text


def check_progress(fraction: Any, message: Any) -> tuple[float | None, str | None]:
    """A valid (fraction, message) pair; ValueError naming what is wrong."""
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise ValueError(f"progress must be a number from 0 to 1, got {fraction!r}")
        if not math.isfinite(fraction) or not 0 <= fraction <= 1:
            raise ValueError(f"progress must be from 0 to 1, got {fraction!r}")
        fraction = float(fraction)
    if message is not None:
        if not isinstance(message, str):
            raise ValueError(f"progress message must be a string, got {message!r}")
        message = message.replace("\x00", "")[:MAX_MESSAGE]
    return fraction, message


class _Piece:
    """Output bytes at ``pos`` of one stream; ``sealed`` once handed to a flush."""

    __slots__ = ("data", "pos", "sealed", "stream")

    def __init__(self, pos: int, stream: str, data: bytes) -> None:
        self.pos = pos
        self.stream = stream
        self.data = bytearray(data)
        self.sealed = False


@dataclass
class Taken:
    """What one flush took from one attempt (given back if the flush fails)."""

    pieces: list[_Piece]
    progress: tuple[float | None, str | None] | None
    checkpoint: str | None
    prune: tuple[int, int] | None


class LiveOutput:
    """The news of one attempt not written yet. Output comes from the event loop;
    progress and checkpoints may come from a sync job's thread (hence the lock)."""

    __slots__ = ("_beyond", "_checkpoint", "_control", "_flushed_beyond", "_fraction",
                 "_lock", "_notes", "_progress", "flushed", "limit", "pending", "pos")

    def __init__(self, limit: int = DEFAULT_LOG_LIMIT) -> None:
        self.limit = limit if limit >= MIN_LOG_LIMIT else MIN_LOG_LIMIT
        self.pos = 0  # bytes of output produced so far
        self.pending: list[_Piece] = []
        self.flushed = False  # some chunk of this attempt was stored
        self._beyond = 0  # pending bytes past the head
        self._flushed_beyond = False
        self._fraction: float | None = None
        self._progress: tuple[float | None, str | None] | None = None
        self._checkpoint: str | None = None
        self._lock = threading.Lock()
        self._control = b""
        self._notes = 0

    @property
    def head(self) -> int:
        return self.limit // 2

    # ------------------------------------------------------------ output

    def write(self, stream: str, chunk: bytes) -> None:
        if not chunk:
            return
        start = self.pos
        self.pos += len(chunk)
        head = self.head
        if start < head < self.pos:  # split at the head's end
            self._append(stream, start, chunk[: head - start])
            chunk, start = chunk[head - start :], head
        self._append(stream, start, chunk)
        if start >= head:
            self._beyond += len(chunk)
            self._trim()

    def out(self, chunk: bytes) -> None:
        self.write("stdout", chunk)

    def err(self, chunk: bytes) -> None:
        self.write("stderr", chunk)

    def note(self, text: str) -> None:
        """A warning of pgflow's in the attempt's log (at most ``MAX_NOTES``)."""
        self._notes += 1
        if self._notes <= MAX_NOTES:
            suffix = " (further warnings are not shown)" if self._notes == MAX_NOTES else ""
            self.write("pgflow", f"[pgflow] {text}{suffix}\n".encode())

    def _append(self, stream: str, pos: int, chunk: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if (last is not None and not last.sealed and last.stream == stream
                and last.pos + len(last.data) == pos and len(last.data) < CHUNK_MAX
                and (last.pos >= self.head) == (pos >= self.head)):  # head, tail: apart
            last.data += chunk
        else:
            self.pending.append(_Piece(pos, stream, chunk))

    def _trim(self) -> None:
        """Keep at most the tail's share of pending bytes past the head."""
        keep = self.limit - self.head
        head = self.head
        i = 0
        while self._beyond > keep and i < len(self.pending):
            piece = self.pending[i]
            if piece.pos < head:
                i += 1
                continue
            excess = self._beyond - keep
            if len(piece.data) <= excess:
                del self.pending[i]
                self._beyond -= len(piece.data)
            else:
                del piece.data[:excess]
                piece.pos += excess
                self._beyond -= excess

    # ------------------------------------------------------------ progress, checkpoints

    def progress(self, fraction: float | None, message: str | None) -> None:
        """Validated already (``check_progress``). A message alone keeps the fraction."""
        with self._lock:
            if fraction is None:
                fraction = self._fraction
            self._fraction = fraction
            self._progress = (fraction, message)

    def checkpoint(self, text: str) -> None:
        """Encoded already (``encode_checkpoint``)."""
        with self._lock:
            self._checkpoint = text

    def control(self, data: bytes) -> None:
        """Bytes read from the command's control pipe: JSON lines. Only the newest
        progress and checkpoint of what arrived matter, so lines are read newest first
        and the older ones are only parsed if they may hold a checkpoint still unseen."""
        self._control += data
        if b"\n" not in data:
            if len(self._control) > MAX_CONTROL_LINE:
                self.note(f"control line longer than {MAX_CONTROL_LINE:,} bytes ignored")
                self._control = b""
            return
        *lines, self._control = self._control.split(b"\n")
        self._lines(lines)

    def end_control(self) -> None:
        """The control pipe closed: a last line without a newline still counts."""
        if self._control.strip():
            self._lines([self._control])
        self._control = b""

    def _lines(self, lines: list[bytes]) -> None:
        got_progress = got_checkpoint = False
        refused: list[str] = []
        for line in reversed(lines):
            if not line.strip():
                continue
            if got_progress and (got_checkpoint or b"checkpoint" not in line):
                continue
            try:
                found = self._line(line, got_progress, got_checkpoint)
            except ValueError as exc:
                refused.append(f"control line ignored: {exc}")
                continue
            got_progress = got_progress or "progress" in found
            got_checkpoint = got_checkpoint or "checkpoint" in found
        for text in reversed(refused):  # in the order the job wrote them
            self.note(text)

    def _line(self, line: bytes, skip_progress: bool, skip_checkpoint: bool) -> set[str]:
        try:
            message = json.loads(line)
        except ValueError:
            shown = line[:80].decode("utf-8", errors="replace")
            raise ValueError(f"not a JSON object: {shown!r}") from None
        if not isinstance(message, dict) or not message.keys() & {
                "progress", "message", "checkpoint"}:
            raise ValueError('expected {"progress": 0..1, "message": "..."} or'
                             ' {"checkpoint": ...}')
        found: set[str] = set()
        if "checkpoint" in message and not skip_checkpoint:
            self.checkpoint(encode_checkpoint(message["checkpoint"]))
            found.add("checkpoint")
        if (message.keys() & {"progress", "message"}) and not skip_progress:
            fraction, text = check_progress(message.get("progress"), message.get("message"))
            self.progress(fraction, text)
            found.add("progress")
        return found

    # ------------------------------------------------------------ flushing

    @property
    def dirty(self) -> bool:
        return bool(self.pending) or self._progress is not None or self._checkpoint is not None

    def needs_final(self) -> bool:
        """At the attempt's end: news that only a flush can store. Output is left to
        the tails when nothing was stored yet and the tails hold all of it."""
        if self._progress is not None or self._checkpoint is not None:
            return True
        return bool(self.pending) and (self.flushed or self.pos > TAIL_BYTES)

    def take(self, budget: int) -> Taken:
        pieces: list[_Piece] = []
        used = 0
        while self.pending and (not pieces or used + len(self.pending[0].data) <= budget):
            piece = self.pending.pop(0)
            piece.sealed = True
            used += len(piece.data)
            if piece.pos >= self.head:
                self._beyond -= len(piece.data)
            pieces.append(piece)
        with self._lock:
            progress, self._progress = self._progress, None
            checkpoint, self._checkpoint = self._checkpoint, None
        prune = None
        if self.pos > self.limit and self._flushed_beyond:
            prune = (self.head, self.pos - (self.limit - self.head))
        return Taken(pieces, progress, checkpoint, prune)

    def written(self, taken: Taken) -> None:
        if taken.pieces:
            self.flushed = True
            if any(p.pos >= self.head for p in taken.pieces):
                self._flushed_beyond = True

    def give_back(self, taken: Taken) -> None:
        """The flush failed: what it took waits for the next one (sealed pieces are
        written again as they were: a commit whose reply was lost conflicts, harmlessly)."""
        self.pending[:0] = taken.pieces
        self._beyond += sum(len(p.data) for p in taken.pieces if p.pos >= self.head)
        self._trim()
        with self._lock:
            if self._progress is None:
                self._progress = taken.progress
            if self._checkpoint is None:
                self._checkpoint = taken.checkpoint


Key = tuple[int, int]


class Flusher:
    """Writes the news of a worker's running attempts, every ``FLUSH_S``."""

    def __init__(self, worker_id: str, attempts: Callable[[], Iterable[tuple[Key, LiveOutput]]],
                 connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]], log: Any,
                 bound_s: float, period: float = FLUSH_S) -> None:
        self.worker_id = worker_id
        self._attempts = attempts
        self._connect = connect
        self.log = log
        self._bound_s = bound_s
        self._period = period
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._flushes = 0
        self._done = asyncio.Condition()

    async def loop(self) -> None:
        failures = 0
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self._period)
                self._wake.clear()
                try:
                    await self.flush()
                    failures = 0
                except psycopg.Error as exc:
                    failures += 1
                    self.log.warning("live output: database error, retrying",
                                     error=str(exc).strip(), failures=failures)
                    await self._drop_conn()
                    await asyncio.sleep(min(5.0, 0.1 * 2**failures))
        finally:
            await self._drop_conn()

    async def final(self, key: Key, live: LiveOutput, timeout: float) -> None:
        """The attempt ended: store what it reported last, before its result."""
        deadline = time.monotonic() + timeout
        while live.needs_final():
            left = deadline - time.monotonic()
            if left <= 0:
                self.log.warning("live output: the last output and checkpoint of an attempt"
                                 " could not be stored in time", run_id=key[0], attempt=key[1])
                return
            seen = self._flushes
            self._wake.set()
            async with self._done:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._done.wait_for(partial(self._since, seen)),
                                           timeout=left)

    def _since(self, seen: int) -> bool:
        return self._flushes > seen

    async def flush(self) -> None:
        async with self._lock:
            try:
                await self._flush_once()
            finally:
                self._flushes += 1
                async with self._done:
                    self._done.notify_all()

    async def _flush_once(self) -> None:
        batch: list[tuple[Key, LiveOutput, Taken]] = []
        budget = FLUSH_MAX_BYTES
        for key, live in list(self._attempts()):
            if live.dirty:
                taken = live.take(max(budget, 1))
                budget -= sum(len(p.data) for p in taken.pieces)
                batch.append((key, live, taken))
        if not batch:
            return
        from pgflow.db import bounded  # pgflow.db -> pgflow.config -> this module

        try:
            self._conn = self._conn or await self._connect()
            row = await bounded(self._conn, self._write(self._conn, batch), self._bound_s,
                                "live output")
        except BaseException:
            for _, live, taken in batch:
                live.give_back(taken)
            raise
        held = {(int(run_id), int(attempt)) for run_id, attempt in row["held"]}
        for key, live, taken in batch:
            if key in held:
                live.written(taken)
            elif self.log is not None:
                self.log.warning("live output dropped: the attempt no longer holds its lease",
                                 run_id=key[0], attempt=key[1],
                                 bytes=sum(len(p.data) for p in taken.pieces))
        if any(live.pending for _, live, _ in batch):
            self._wake.set()  # more than one statement's worth: go on at once

    async def _write(self, conn: psycopg.AsyncConnection[Any],
                     batch: list[tuple[Key, LiveOutput, Taken]]) -> dict[str, Any]:
        params = flush_params(self.worker_id, batch)
        cur = await conn.execute(q("live_flush"), params)
        row = await cur.fetchone()
        assert row is not None
        return {"held": row[0]}

    async def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


def flush_params(worker_id: str, batch: list[tuple[Key, LiveOutput, Taken]]) -> dict[str, Any]:
    """The arrays of one ``live_flush`` statement."""
    p: dict[str, list[Any]] = {name: [] for name in (
        "ids", "attempts", "c_ids", "c_attempts", "c_pos", "c_streams", "c_data", "s_ids",
        "s_attempts", "s_has_progress", "s_progress", "s_messages", "s_checkpoints", "p_ids",
        "p_attempts", "p_from", "p_before")}
    for (run_id, attempt), _, taken in batch:
        p["ids"].append(run_id)
        p["attempts"].append(attempt)
        for piece in taken.pieces:
            p["c_ids"].append(run_id)
            p["c_attempts"].append(attempt)
            p["c_pos"].append(piece.pos)
            p["c_streams"].append(piece.stream)
            p["c_data"].append(bytes(piece.data))
        if taken.progress is not None or taken.checkpoint is not None:
            p["s_ids"].append(run_id)
            p["s_attempts"].append(attempt)
            p["s_has_progress"].append(taken.progress is not None)
            p["s_progress"].append(taken.progress[0] if taken.progress else None)
            p["s_messages"].append(taken.progress[1] if taken.progress else None)
            p["s_checkpoints"].append(taken.checkpoint)
        if taken.prune is not None:
            p["p_ids"].append(run_id)
            p["p_attempts"].append(attempt)
            p["p_from"].append(taken.prune[0])
            p["p_before"].append(taken.prune[1])
    return {"worker": worker_id, **p}


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class OutputPage:
    """Output of one attempt from ``offset`` on: ``data`` (gaps shown as markers),
    ``next_offset`` to continue from, and whether the attempt still runs."""

    run_id: int
    attempt: int
    offset: int
    next_offset: int
    data: bytes
    running: bool

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def dropped_marker(count: int) -> bytes:
    return f"\n[pgflow] ... {count:,} bytes of output dropped (PGFLOW_LOG_LIMIT) ...\n".encode()


def read_output(conn: psycopg.Connection[Any], run_id: int, attempt: int | None = None,
                offset: int = 0, max_bytes: int = 1024 * 1024) -> OutputPage:
    """Raises NotFound for an unknown run or attempt, InvalidInput for a bad offset."""
    from pgflow.errors import InvalidInput, NotFound

    if not 0 < run_id < 2**63:
        raise NotFound(f"no run {run_id} (see 'pgflow runs list')")
    if not 0 <= offset <= 2**62:
        raise InvalidInput(f"offset must be 0 or more, got {offset}")
    if attempt is not None and not 0 < attempt < 2**31:
        raise InvalidInput(f"attempt must be 1 or more, got {attempt}")
    found = conn.execute("SELECT attempt FROM pgflow.runs WHERE id = %s", (run_id,)).fetchone()
    if found is None:
        raise NotFound(f"no run {run_id} (see 'pgflow runs list')")
    current = int(_row(found)[0])
    if attempt is None:
        attempt = max(current, 1)
    cur = conn.cursor(row_factory=psycopg.rows.dict_row)
    info = cur.execute(q("run_output_attempt"), {"id": run_id, "attempt": attempt}).fetchone()
    assert info is not None
    if attempt > current or not (info["running"] or info["finished"] or info["has_chunks"]):
        raise NotFound(f"run {run_id} has no attempt {attempt} yet"
                       + (f" (its attempts: 1..{current})" if current else ""))
    if info["has_chunks"]:
        data, end = _from_chunks(cur, run_id, attempt, offset, max_bytes)
    else:
        whole = _from_tails(info["stdout_tail"], info["stderr_tail"])
        data = whole[offset : offset + max_bytes]
        end = max(offset, min(len(whole), offset + len(data)))
    return OutputPage(run_id, attempt, offset, end, data, bool(info["running"]))


def _row(row: Any) -> tuple[Any, ...]:
    return tuple(row.values()) if isinstance(row, dict) else tuple(row)


def _from_tails(stdout: str | None, stderr: str | None) -> bytes:
    out = (stdout or "").encode()
    err = (stderr or "").encode()
    if out and err and not out.endswith(b"\n"):
        out += b"\n"
    return out + err


def _from_chunks(cur: psycopg.Cursor[dict[str, Any]], run_id: int, attempt: int, offset: int,
                 max_bytes: int) -> tuple[bytes, int]:
    rows = cur.execute(q("run_output_read"), {"id": run_id, "attempt": attempt,
                                               "offset": offset, "limit": READ_CHUNKS}
                       ).fetchall()
    data = bytearray()
    at = offset
    for row in rows:
        pos, chunk = int(row["pos"]), bytes(row["data"])
        if pos + len(chunk) <= at:
            continue
        if data and len(data) + pos + len(chunk) - at > max_bytes:
            break
        if pos > at:
            data += dropped_marker(pos - at)
            at = pos
        data += chunk[at - pos :]
        at = pos + len(chunk)
    return bytes(data), at


PAGE_BYTES = 64 * 1024


def page_output(conn: psycopg.Connection[Any], run_id: int, attempt: int,
                state: str) -> dict[str, Any] | None:
    """The newest ``PAGE_BYTES`` of the stored output of the run's latest attempt, for the
    run page (which refreshes while it runs); None when it stored none and is over."""
    if attempt < 1:
        return None
    cur = conn.cursor(row_factory=psycopg.rows.dict_row)
    end = cur.execute(q("run_output_end"), {"id": run_id, "attempt": attempt}).fetchone()
    running = state == "running"
    total = int(end["output_end"]) if end and end["output_end"] is not None else 0
    if not total and not running:
        return None
    data, _ = _from_chunks(cur, run_id, attempt, max(0, total - PAGE_BYTES), PAGE_BYTES)
    return {"attempt": attempt, "running": running, "next_offset": total,
            "shown": min(total, PAGE_BYTES), "text": data.decode("utf-8", errors="replace")}
