"""The round's POST without httpx's layers (issue 33, docs/performance.md): HTTP/1.1 over kept-alive asyncio
streams per host and port, one call at a time (a kept one the server had closed is retried once on a fresh
one). Failures raise ``httpx`` exceptions of the same kinds, so ``Channel`` maps them alike. Only ``http://``
URLs: ``Channel`` uses httpx for the rest."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

_MAX_HEAD = 64 * 1024
MAX_IDLE = 64  # kept-alive connections per host and port; past it a finished one is closed


@dataclass(slots=True)
class Answer:
    """What ``Channel.exchange`` reads of a response."""

    status_code: int
    headers: dict[str, str]
    content: bytes


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class FastPost:
    """``await post(url, body, headers, timeout)`` → ``Answer``; ``await aclose()`` at the end."""

    def __init__(self, default_headers: dict[str, str] | None = None) -> None:
        self.default_headers = {k.lower(): v for k, v in (default_headers or {}).items()}
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    @staticmethod
    def handles(url: str) -> bool:
        return url.startswith("http://")

    async def post(self, url: str, body: bytes, headers: dict[str, str], timeout: httpx.Timeout) -> Answer:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request = self._request(target, parts.netloc, body, headers)
        for attempt in (0, 1):
            reused = bool(self._idle.get((host, port)))
            conn = await self._connection(host, port, timeout)
            try:
                answer, keep = await self._exchange(
                    conn, request, timeout, may_be_stale=reused and attempt == 0
                )
            except _Stale:
                conn.close()
                continue  # the server closed it while idle: once more on a fresh connection
            except BaseException:
                conn.close()
                raise
            idle = self._idle.setdefault((host, port), [])
            if keep and len(idle) < MAX_IDLE:
                idle.append(conn)
            else:
                conn.close()
            return answer
        raise httpx.RemoteProtocolError(f"{url}: the connection closed before an answer, twice")

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _request(self, target: str, netloc: str, body: bytes, headers: dict[str, str]) -> bytes:
        merged = {**self.default_headers, **{k.lower(): v for k, v in headers.items()}}
        merged.update({"host": netloc, "content-length": str(len(body))})
        head = f"POST {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in merged.items()) + "\r\n"
        return head.encode("latin-1") + body

    async def _connection(self, host: str, port: int, timeout: httpx.Timeout) -> _Connection:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                return conn
            conn.close()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=_MAX_HEAD), timeout.connect
            )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} took over {timeout.connect} s") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"[Errno {exc.errno}] {exc.strerror or exc}") from exc
        return _Connection(reader, writer)

    async def _exchange(
        self, conn: _Connection, request: bytes, timeout: httpx.Timeout, may_be_stale: bool
    ) -> tuple[Answer, bool]:
        try:
            conn.writer.write(request)
            await asyncio.wait_for(conn.writer.drain(), timeout.write)
            head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), timeout.read)
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"no answer within {timeout.read} s") from exc
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if may_be_stale and not getattr(exc, "partial", b""):
                raise _Stale from exc
            raise httpx.RemoteProtocolError(f"the server closed the connection: {exc!r}") from exc
        except asyncio.LimitOverrunError as exc:
            raise httpx.RemoteProtocolError("response headers over 64 KiB") from exc
        status, headers = _parse_head(head)
        try:
            content = await asyncio.wait_for(self._body(conn.reader, status, headers), timeout.read)
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"the answer's body took over {timeout.read} s") from exc
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            raise httpx.RemoteProtocolError(f"the answer's body was cut: {exc!r}") from exc
        keep = headers.get("connection", "").lower() != "close"
        return Answer(status, headers, content), keep

    @staticmethod
    async def _body(reader: asyncio.StreamReader, status: int, headers: dict[str, str]) -> bytes:
        if status in (204, 304) or status < 200:
            return b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            chunks: list[bytes] = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                        pass
                    return b"".join(chunks)
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
        length = headers.get("content-length")
        if length is None:
            return await reader.read()  # until the server closes (it must: no length given)
        return await reader.readexactly(int(length))


class _Stale(Exception):
    """A kept-alive connection the server had closed: retry on a fresh one."""


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest.partition(" ")[0]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
    return int(code), headers
