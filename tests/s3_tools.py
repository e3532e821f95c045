"""Test-only helpers for object storage: an HTTP proxy in front of the embedded S3 server that
can forget conditional writes (so the safety probe has a store to refuse), go down like a
stopped server, and lose the answer to a commit the server did apply."""

from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from offsetlake.embedded.local_broker import free_port

_COMMIT = re.compile(r"/_delta_log/\d{20}\.json$")


class S3Proxy:
    """Forwards every request to ``endpoint``, unless told otherwise:

    * ``forget_conditions``: drop the ``If-None-Match`` header, as a store without conditional
      writes would (a second put-if-absent of a key then succeeds);
    * ``down``: close every connection without an answer, as a stopped server does;
    * ``lose_next_commit_answer(table)``: forward the next PUT of a Delta log file under
      ``table``'s key, then close the connection without answering: the commit is applied, the
      writer does not know.
    """

    def __init__(self, endpoint: str, forget_conditions: bool = False) -> None:
        target = urlsplit(endpoint)
        self.port = free_port()
        self.forget_conditions = forget_conditions
        self.down = False
        self.commits_seen: list[str] = []
        self._lose: str | None = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                if proxy.down:
                    self.close_connection = True
                    return
                body = self._body()
                dropped = {"host", "expect"} | ({"if-none-match"} if proxy.forget_conditions else set())
                headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                upstream.close()
                path = urlsplit(self.path).path
                if self.command == "PUT" and _COMMIT.search(path):
                    proxy.commits_seen.append(path)
                    if proxy._lose is not None and proxy._lose in path and answer.status < 300:
                        proxy._lose = None
                        self.close_connection = True  # applied upstream; the writer never hears
                        return
                head = self.command == "HEAD"  # no body; its Content-Length is the object's size
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection") and (head or key.lower() != "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _body(self) -> bytes | None:
                """The request body as sent: Content-Length bytes, or the chunked stream verbatim
                (pyarrow's S3 client uploads parts aws-chunked, with a checksum trailer)."""
                if "chunked" not in (self.headers.get("Transfer-Encoding") or "").lower():
                    length = int(self.headers.get("Content-Length") or 0)
                    return self.rfile.read(length) if length else None
                raw = b""
                while True:
                    line = self.rfile.readline()
                    raw += line
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while True:  # trailer lines, then the empty line
                            trailer = self.rfile.readline()
                            raw += trailer
                            if trailer in (b"\r\n", b"\n", b""):
                                return raw
                    raw += self.rfile.read(size + 2)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lose_next_commit_answer(self, table_key: str) -> None:
        self._lose = table_key

    def __enter__(self) -> S3Proxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
