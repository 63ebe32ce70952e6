"""The agent's HTTP server: /metrics, /healthz, and a route table other parts plug into.

Standard library only (http.server, with a pool of worker threads). /metrics renders the collectors' cached
samples; nothing on the request path reads a device. Other parts of the agent add routes; the webhook adds

    server.add_route("POST", "/api/v1/alerts", handler)   # handler(Request) -> (status, headers, body)

The server bounds what a client can cost: request bodies over `max_body_bytes` are refused (413) before
they are read, a body needs a Content-Length (411), at most `max_connections` connections are served at
once (503 beyond), an idle keep-alive connection is closed after `read_timeout` seconds, and each request
must arrive and be answered within `request_timeout` seconds of its first byte, however slowly a client
trickles it in (a per-read timeout alone lets one byte every few seconds hold a slot for ever). One more
slot is kept for loopback clients when the others are taken, and serves only `RESERVED_PATHS` (/healthz
and the webhook): sixteen slow clients cannot lock out the health check or an alert.
"""

from __future__ import annotations

import gzip
import http.server
import json
import os
import queue
import selectors
import threading
import time
from dataclasses import dataclass
from email.message import Message
from typing import Callable, Mapping
from urllib.parse import parse_qs, urlsplit

from trainguard import log as tglog
from trainguard.metrics import exposition

Response = tuple[int, Mapping[str, str], bytes]
RESERVED_PATHS = ("/healthz", "/api/v1/alerts")
_LOOPBACK = ("127.", "::1", "::ffff:127.")
_connection = threading.local()     # per worker thread: is the connection it serves on the reserved slot


class RequestTimeout(TimeoutError):
    """The request did not arrive within its deadline (http.server closes the connection on a TimeoutError)."""


class _DeadlineReader:
    """The connection's input with a whole-request deadline.

    Waiting for the first byte of a request is bounded by the idle timeout (keep-alive); from that byte
    on, everything up to the end of the body must arrive within `limit` seconds: each receive gets only
    the time left, so a client trickling one byte at a time is cut off at the deadline.
    """

    CHUNK = 65536

    def __init__(self, sock, idle: float, limit: float):
        self.sock, self.idle, self.limit = sock, idle, limit
        self.buffer = bytearray()
        self.deadline: float | None = None

    def reset(self) -> None:
        """The next request's deadline starts at its first byte."""
        self.deadline = None

    def _fill(self) -> bool:
        if self.deadline is None and not self.buffer:
            self.sock.settimeout(self.idle)
            chunk = self.sock.recv(self.CHUNK)     # TimeoutError when idle too long: http.server closes
        else:
            if self.deadline is None:
                self.deadline = time.monotonic() + self.limit
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"request not complete within {self.limit:g}s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(self.CHUNK)
            except TimeoutError:
                raise RequestTimeout(f"request not complete within {self.limit:g}s") from None
        if self.deadline is None:
            self.deadline = time.monotonic() + self.limit
        self.buffer += chunk
        return bool(chunk)

    def readline(self, limit: int = -1) -> bytes:
        while b"\n" not in self.buffer and (limit < 0 or len(self.buffer) < limit):
            if not self._fill():
                break
        end = self.buffer.find(b"\n") + 1 or len(self.buffer)
        return self._take(end if limit < 0 else min(end, limit))

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.buffer) < size:
            if not self._fill():
                break
        return self._take(len(self.buffer) if size < 0 else min(size, len(self.buffer)))

    def _take(self, n: int) -> bytes:
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Request:
    """What a route handler gets: the body is already read, and within the size limit."""

    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Message                # case-insensitive: request.headers.get("Authorization")
    body: bytes
    client: tuple[str, int]

    def json(self):
        """The body decoded as JSON (raises ValueError on bad JSON)."""
        return json.loads(self.body or b"null")


Handler = Callable[[Request], Response]


def json_response(status: int, payload, headers: Mapping[str, str] | None = None) -> Response:
    body = json.dumps(payload, indent=1, sort_keys=True).encode() + b"\n"
    return status, {"Content-Type": "application/json", **(headers or {})}, body


class AgentServer:
    """A threaded HTTP server with a route table; `agent` (a runner.Agent) provides /metrics and /healthz."""

    def __init__(self, agent=None, host: str = "127.0.0.1", port: int = 9655, *, max_body_bytes: int = 2**20,
                 max_connections: int = 16, read_timeout: float = 10.0, request_timeout: float = 10.0):
        self.agent = agent
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
        self._routes: dict[tuple[str, str], Handler] = {}
        self._slots = threading.BoundedSemaphore(max_connections)
        self._reserved = threading.BoundedSemaphore(1)
        self._log = tglog.get("agent.server")
        self._thread: threading.Thread | None = None
        self._renderer = exposition.Renderer()    # a family unchanged since the last scrape is not rendered again
        self._gzipped: tuple[bytes, bytes] = (b"", gzip.compress(b"", compresslevel=1))   # (body, compressed)
        handler = type("BoundHandler", (_RequestHandler,), {"server_app": self, "timeout": read_timeout,
                                                            "request_timeout": request_timeout})
        self.httpd = _Server((host, port), handler)
        if agent is not None:
            self.add_route("GET", "/metrics", self._metrics)
            self.add_route("GET", "/healthz", self._healthz)
            self.add_route("GET", "/", self._index)

    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        """Serve `method path` (exact path, query string ignored for matching) with `handler`."""
        key = (method.upper(), path)
        if key in self._routes:
            raise ValueError(f"route {method} {path} already taken")
        self._routes[key] = handler

    def remove_route(self, method: str, path: str) -> None:
        """Stop serving `method path` (the parts of a run the agent no longer follows, agent/app.py)."""
        self._routes.pop((method.upper(), path), None)

    def start(self) -> "AgentServer":
        self._thread = threading.Thread(target=self.httpd.serve, name="agent-http", daemon=True)
        self._thread.start()
        self._log.info("listening", url=self.url, routes=[f"{m} {p}" for m, p in sorted(self._routes)])
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.end_serving()
            self._thread.join(5)
        self.httpd.server_close()

    # ---------------------------------------------------------------------------------- routing

    def dispatch(self, method: str, raw_path: str, headers: Message, body: bytes, client) -> Response:
        parts = urlsplit(raw_path)
        if getattr(_connection, "reserved", False) and parts.path not in RESERVED_PATHS:
            return 503, {"Content-Type": "text/plain", "Connection": "close"}, b"busy: only /healthz and the webhook now\n"
        handler = self._routes.get((method, parts.path))
        if handler is None:
            allowed = sorted(m for m, p in self._routes if p == parts.path)
            if allowed:
                return 405, {"Allow": ", ".join(allowed), "Content-Type": "text/plain"}, b"method not allowed\n"
            return 404, {"Content-Type": "text/plain"}, b"not found\n"
        request = Request(method, parts.path, parse_qs(parts.query), headers, body, client)
        try:
            return handler(request)
        except Exception as exc:
            self._log.exception("handler failed", method=method, path=parts.path)
            return 500, {"Content-Type": "text/plain"}, f"internal error: {type(exc).__name__}\n".encode()

    def _metrics(self, request: Request) -> Response:
        body, content_type = exposition.encode(self.agent.registry, request.headers.get("Accept", ""),
                                               self._renderer)
        headers = {"Content-Type": content_type}
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            body, headers["Content-Encoding"] = self._gzip(body), "gzip"
        return 200, headers, body

    def _gzip(self, body: bytes) -> bytes:
        """The body gzipped; a scrape that finds nothing changed since the last one (no update, not even the
        agent's own process_* series) gets the bytes compressed then."""
        last_body, compressed = self._gzipped
        if body != last_body:
            compressed = gzip.compress(body, compresslevel=1)
            self._gzipped = (body, compressed)
        return compressed

    def _healthz(self, request: Request) -> Response:
        return json_response(200, self.agent.health())

    def _index(self, request: Request) -> Response:
        links = "".join(f'<li><a href="{p}">{p}</a></li>' for m, p in sorted(self._routes) if m == "GET" and p != "/")
        html = f"<html><head><title>trainguard agent</title></head><body><h1>trainguard agent</h1><ul>{links}</ul>"
        return 200, {"Content-Type": "text/html; charset=utf-8"}, (html + "</body></html>\n").encode()


class _Server(http.server.HTTPServer):
    """Each connection is served by a worker thread of a pool, at most `http.max_connections` of them.

    A worker that is done with a connection waits for the next one instead of ending, so a scrape on a new
    connection (a probe, curl, a scraper without keep-alive) does not pay for starting a thread.
    """

    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address, handler):
        self._connections: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = self._idle = 0
        self._serving = True
        self._wake_read, self._wake_write = os.pipe()
        super().__init__(address, handler)     # last: a port already taken calls server_close() from here

    def serve(self) -> None:
        """Accept connections until `end_serving()`.

        socketserver's serve_forever wakes every poll interval to look for a shutdown request; this sleeps
        in select() until a connection comes or `end_serving()` writes to a pipe, so an idle agent's HTTP
        thread costs nothing between scrapes.
        """
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while self._serving:
                for key, _ in selector.select():
                    if key.fileobj is self and self._serving:
                        self._handle_request_noblock()   # socketserver's accept-and-dispatch, as serve_forever

    def end_serving(self) -> None:
        self._serving = False
        if self._wake_write >= 0:
            os.write(self._wake_write, b"x")

    def process_request(self, request, client_address):
        app = self.RequestHandlerClass.server_app
        reserved = self._take_slot(app, client_address)
        if reserved is None:
            # Too many connections at once: answer 503 on the spot rather than queue threads without bound.
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                _drain(request)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._lock:    # an idle worker takes the connection, else a new one (a slot each: bounded)
            start = self._idle == 0
            if start:
                self._workers += 1
            else:
                self._idle -= 1
        self._connections.put((request, client_address, reserved))
        if start:
            threading.Thread(target=self._work, name="agent-http-worker", daemon=True).start()

    def _work(self) -> None:
        app = self.RequestHandlerClass.server_app
        while (connection := self._connections.get()) is not None:
            request, client_address, reserved = connection
            _connection.reserved = reserved
            try:
                self.finish_request(request, client_address)
            except RequestTimeout:
                pass                       # a client too slow for its deadline: dropped
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                with self._lock:
                    self._idle += 1
                (app._reserved if reserved else app._slots).release()

    @staticmethod
    def _take_slot(app, client_address) -> bool | None:
        """False: a general slot; True: the reserved one (loopback, when the others are taken); None: none."""
        if app._slots.acquire(blocking=False):
            return False
        if str(client_address[0]).startswith(_LOOPBACK) and app._reserved.acquire(blocking=False):
            return True
        return None

    def server_close(self) -> None:
        super().server_close()
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                os.close(fd)
        self._wake_read = self._wake_write = -1      # closed: never close a number the system gave out again
        with self._lock:
            workers = self._workers
        for _ in range(workers):      # idle workers end; one inside a connection ends when it is done
            self._connections.put(None)


class _RequestHandler(http.server.BaseHTTPRequestHandler):
    server_app: AgentServer
    protocol_version = "HTTP/1.1"   # keep-alive, as Prometheus scrapes
    server_version = "trainguard-agent"
    request_timeout = 10.0

    def setup(self) -> None:
        super().setup()
        self.rfile = _DeadlineReader(self.connection, self.timeout, self.request_timeout)

    def handle_one_request(self) -> None:
        self.rfile.reset()
        super().handle_one_request()

    def do_GET(self) -> None:
        self._handle(b"")

    def do_HEAD(self) -> None:
        self._handle(b"", head=True)

    def do_POST(self) -> None:
        body = self._read_body()
        if body is not None:
            self._handle(body)

    do_PUT = do_DELETE = do_POST

    def _read_body(self) -> bytes | None:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self._send(411, {"Content-Type": "text/plain"}, b"a request body needs a Content-Length\n", close=True)
            return None
        try:
            length = int(length_header)
            if length < 0:
                raise ValueError
        except ValueError:
            self._send(400, {"Content-Type": "text/plain"}, b"bad Content-Length\n", close=True)
            return None
        limit = self.server_app.max_body_bytes
        if length > limit:
            self._send(413, {"Content-Type": "text/plain"},
                       f"request body of {length} bytes is over the limit of {limit}\n".encode(), close=True)
            return None
        return self.rfile.read(length)

    def _handle(self, body: bytes, head: bool = False) -> None:
        method = "GET" if head else self.command
        status, headers, payload = self.server_app.dispatch(method, self.path, self.headers, body,
                                                            self.client_address)
        self._send(status, headers, b"" if head else payload, length=len(payload))

    def _send(self, status: int, headers: Mapping[str, str], body: bytes, close: bool = False,
              length: int | None = None) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        pass  # one line per scrape is noise; errors are logged where they happen


REFUSED_DRAIN_SECONDS = 0.02


def _drain(sock) -> None:
    """Read what a refused client has sent so far (briefly: this is the accept thread). Closing a socket
    with unread data resets the connection, and the client then sees a broken pipe, not the 503."""
    sock.settimeout(REFUSED_DRAIN_SECONDS)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass

