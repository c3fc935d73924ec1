"""Every HTTP server rollmesh starts bounds a connection before any credential is read: a header not
whole in time is closed, and connections past the cap are closed as they come."""

from __future__ import annotations

import asyncio
import socket

import httpx
from fastapi import FastAPI

from services.auth import AuthConfig
from services.http_limits import GuardedHttp, uvicorn_config
from services.processes import free_port


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True if the server closes ``sock`` (recv gives b"") within ``within_s``."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_slow_header_is_cut_and_connections_past_the_cap_are_refused(monkeypatch):
    import uvicorn

    monkeypatch.setattr(GuardedHttp, "header_timeout_s", 0.5)
    monkeypatch.setattr(GuardedHttp, "max_connections", 4)
    app = FastAPI()

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, AuthConfig(disabled=True)))

    async def main():
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:

            def probe():
                held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
                held[0].sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # half a header; the others send nothing
                extra = socket.create_connection(("127.0.0.1", port))  # the fifth: over the cap
                refused = _closed_by_server(extra, 0.2)  # at once: well before its header deadline
                cut = [_closed_by_server(s, 5.0) for s in held]  # each within the header deadline
                for s in [*held, extra]:
                    s.close()
                with httpx.Client() as c:  # a whole request, on time, is served (and twice on one connection)
                    answers = [c.get(f"http://127.0.0.1:{port}/ok").json() for _ in range(2)]
                return refused, cut, answers

            return await asyncio.to_thread(probe)
        finally:
            server.should_exit = True
            await task

    refused, cut, answers = asyncio.run(main())
    assert refused and cut == [True] * 4 and answers == [{"ok": True}] * 2
