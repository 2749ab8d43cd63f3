"""The gateway's HTTP/1.1 parser: uvicorn's httptools protocol, with a bound on a request's head.

httptools (llhttp, in C) costs the gateway less CPU per streamed request than uvicorn's default,
the pure-Python h11 (docs/benchmarks.md, benchmarks.gateway_auth). But uvicorn bounds a request
line plus headers only on its h11 path (16 KiB); on the httptools path a client could send
megabytes of headers, all held in memory before the API-key gate runs. This protocol refuses a
head past MAX_REQUEST_HEAD_BYTES as the h11 path does: 400 and the connection closed. Importing
this module imports httptools, so a gateway installed without it fails at start.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# h11's bound in uvicorn (h11_max_incomplete_event_size), which the gateway ran with before.
MAX_REQUEST_HEAD_BYTES = 16 * 1024
# The ": " and CRLF of a header line, which httptools does not pass on.
_HEADER_LINE_OVERHEAD = 4


class HeadTooLarge(Exception):
    """Raised in a parser callback: httptools stops and uvicorn answers 400 and closes."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """Two counts, both reset by each request: the head's URL and header lines as the parser
    hands them over (exact, but only once each is whole), and the bytes of reads in which no
    head or request ended and after which a head is still incomplete (a header trickled in, or
    one too long to ever end, which httptools would keep buffering)."""

    _is_in_head = True  # between requests too: the next bytes start a head
    _head_bytes = 0  # URL and header lines of this head
    _incomplete_read_bytes = 0
    _num_ends = 0  # heads and messages ended on this connection

    def data_received(self, data: bytes) -> None:
        num_ends = self._num_ends
        super().data_received(data)
        # A read in which a head or a message ended holds body bytes, maybe whole requests:
        # not counted (what it may add to a head is one read).
        if num_ends != self._num_ends or not self._is_in_head or self.transport.is_closing():
            return
        self._incomplete_read_bytes += len(data)
        if self._incomplete_read_bytes > MAX_REQUEST_HEAD_BYTES:
            self.send_400_response("Request header fields too large.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + _HEADER_LINE_OVERHEAD)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._is_in_head = False
        self._num_ends += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._num_ends += 1
        self._is_in_head = True
        self._incomplete_read_bytes = 0

    def _count(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > MAX_REQUEST_HEAD_BYTES:
            raise HeadTooLarge(f"request head past {MAX_REQUEST_HEAD_BYTES} bytes")
