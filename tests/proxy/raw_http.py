"""A bare HTTP/1.1 client over asyncio streams, for what aiohttp's client will not send: bodies in
many pieces with pauses, short bodies, half-closes, dribbled headers."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import msgspec


def head(path: str, *, length: int | None = None, chunked: bool = False, extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def chunked(pieces: list[bytes]) -> list[bytes]:
    return [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces] + [b"0\r\n\r\n"]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection without an answer")
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, msgspec.json.decode(body) if body else {}


async def exchange(url: str, parts: list[bytes], *, pause: float = 0.0, half_close: bool = False,
                   timeout: float = 10.0) -> tuple[int, dict]:
    """Send ``parts`` one by one (``pause`` seconds apart), optionally shut our side, read the answer."""
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        async with asyncio.timeout(timeout):
            for p in parts:
                writer.write(p)
                await writer.drain()
                if pause:
                    await asyncio.sleep(pause)
            if half_close:
                writer.write_eof()
            return await read_response(reader)
    finally:
        writer.close()
