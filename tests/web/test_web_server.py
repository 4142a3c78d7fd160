"""run_web: uvicorn inside the caller's event loop, stopped by an event."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest
from webhelpers import Conn, free_port

from pgflow import tokens
from pgflow.config import load_settings
from pgflow.errors import PgflowError
from pgflow.log import get_logger
from pgflow.web import run_web


async def _serve_once(db_url: str, tmp_path: Path, bind: str) -> int:
    settings = load_settings({"PGFLOW_HOME": str(tmp_path)}, database_url=db_url)
    stop = asyncio.Event()
    task = asyncio.create_task(run_web(db_url, settings, bind, stop, get_logger(test=True)))
    async with httpx.AsyncClient(timeout=1.0) as client:
        for _ in range(200):
            if task.done():
                await task  # raises what run_web refused with
            try:
                response = await client.get(f"http://{bind}/healthz")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the web role did not start")
    stop.set()
    await asyncio.wait_for(task, 15)
    return response.status_code


def test_serves_until_stopped(db_url: str, tmp_path: Path) -> None:
    bind = f"127.0.0.1:{free_port()}"
    assert asyncio.run(_serve_once(db_url, tmp_path, bind)) == 200
    with socket.socket() as sock:  # the port is free again
        sock.bind(("127.0.0.1", int(bind.rsplit(":", 1)[1])))


def test_refuses_a_public_bind_without_an_admin_token(db_url: str, tmp_path: Path,
                                                      conn: Conn) -> None:
    bind = f"0.0.0.0:{free_port()}"
    with pytest.raises(PgflowError, match="no admin token exists yet"):
        asyncio.run(_serve_once(db_url, tmp_path, bind))
    tokens.create(conn, "admin")
    assert asyncio.run(_serve_once(db_url, tmp_path, bind.replace("0.0.0.0", "127.0.0.1"))) \
        == 200


def test_a_busy_port_is_one_clear_error(db_url: str, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        bind = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(PgflowError, match=f"cannot serve the web role on {bind}"):
            asyncio.run(_serve_once(db_url, tmp_path, bind))
