"""Test-only helpers for object storage: an HTTP proxy that makes an S3 server forget
conditional writes (so the safety probe has a store to refuse)."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from offsetlake.embedded.local_broker import free_port


class ForgetfulProxy:
    """Forwards every request to ``endpoint`` without its ``If-None-Match`` header: a store that
    accepts a second put-if-absent of the same key, as some S3-compatible stores did before they
    supported conditional writes."""

    def __init__(self, endpoint: str) -> None:
        target = urlsplit(endpoint)
        self.port = free_port()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("if-none-match", "host")}
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                head = self.command == "HEAD"  # no body; its Content-Length is the object's size
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection") and (head or key.lower() != "content-length"):
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ForgetfulProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
