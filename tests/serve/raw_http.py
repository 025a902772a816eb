"""Malformed HTTP sent byte for byte to a server on loopback, and the answers read back."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

#: Requests that aiohttp's parser, its framing or the routing refuses, by what is wrong with them.
MALFORMED: dict[str, bytes] = {
    "request line": b"GARBAGE\r\n\r\n",
    "control byte in the request line": b"GET /he\x01lth HTTP/1.1\r\nHost: x\r\n\r\n",
    "HTTP version": b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    "header without a colon": b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    "Content-Length not a number": b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    "header line too long": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    "Content-Length and Transfer-Encoding": (b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                             b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "Content-Length shorter than the body": (b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"
                                             b"{}\x01\x02 not a request\r\n\r\n"),
    "bad chunk size": b"POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
    "no such path": b"GET /no/such/path HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
}


def _responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            raise AssertionError(f"not an HTTP response: {data[:200]!r}")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        n = int(headers.get("content-length", len(rest)))
        out.append((status, headers, rest[:n]))
        data = rest[n:]
    return out


async def exchange(url: str, data: bytes, timeout_s: float = 10.0) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``data`` to ``url``'s host and port, half-close, and read every answer until the server
    closes: ``[(status, headers, body)]``."""
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        writer.write(data)
        await writer.drain()
        got = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    return _responses(got)


def error_answers(url: str, data: bytes) -> list[tuple[int, object]]:
    """``exchange`` from synchronous code: for each answer of status >= 400, (status, its JSON
    ``error``); asserts each is JSON with an ``error`` (and that there is at least one)."""
    answers = asyncio.run(exchange(url, data))
    return check_errors(answers)


def check_errors(answers) -> list[tuple[int, object]]:
    errors = []
    for status, headers, body in answers:
        if status < 400:
            continue
        assert headers.get("content-type", "").startswith("application/json"), (status, headers, body[:200])
        doc = json.loads(body)
        assert isinstance(doc, dict) and "error" in doc, doc
        errors.append((status, doc["error"]))
    assert errors, answers
    return errors
