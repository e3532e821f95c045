"""Test-only helpers for object storage: a TCP proxy in front of the embedded S3 server that can
forget conditional writes (so the safety probe has a store to refuse), go down like a stopped
server, and lose the answer to a commit the server did apply.

It forwards bytes, not HTTP: what the clients send reaches the server as sent (pyarrow's
aws-chunked uploads, keep-alive, HEAD), and "down" closes the sockets the way a dead server
does. It looks at the request lines and headers only to find a commit or a condition.

The proxy runs in its own process, controlled through shared memory: some deltalake calls
(``DeltaTable.is_deltatable``) hold the GIL while they wait for the store, so a proxy thread in
the test's process would never get to forward their request."""

from __future__ import annotations

import multiprocessing
import re
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from offsetlake.embedded.local_broker import free_port

_COMMIT_PUT = re.compile(rb"PUT (\S*/_delta_log/\d{20}\.json)\S* HTTP/1\.1\r\n")
_IF_NONE_MATCH = re.compile(rb"\r\nif-none-match:[^\r\n]*", re.IGNORECASE)


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.lose_answer = False

    def close(self) -> None:
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class _State:
    """What the test and the proxy process share."""

    def __init__(self, ctx: Any, forget_conditions: bool) -> None:
        self.down = ctx.Value("b", 0, lock=False)
        self.forget_conditions = ctx.Value("b", int(forget_conditions), lock=False)
        self.lose = ctx.Array("c", 1024, lock=False)  # a table's key: lose the next commit answer under it
        self.commits_seen = ctx.Value("i", 0)
        self.answers_lost = ctx.Value("i", 0)


class _Server:
    """The proxy itself, in its own process."""

    def __init__(self, listener: socket.socket, target: tuple[str, int], state: _State) -> None:
        self.listener, self.target, self.state = listener, target, state
        self.links: set[_Link] = set()
        self.lock = threading.Lock()

    def serve(self) -> None:
        threading.Thread(target=self._watch_down, daemon=True).start()
        while True:
            client, _ = self.listener.accept()
            if self.state.down.value:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=30)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            link = _Link(client, upstream)
            with self.lock:
                self.links.add(link)
            threading.Thread(target=self._requests, args=(link,), daemon=True).start()
            threading.Thread(target=self._answers, args=(link,), daemon=True).start()

    def _watch_down(self) -> None:
        """Cut every open connection as soon as the store goes down."""
        event = threading.Event()
        while True:
            if self.state.down.value:
                with self.lock:
                    links, self.links = list(self.links), set()
                for link in links:
                    link.close()
            event.wait(0.01)

    def _requests(self, link: _Link) -> None:
        try:
            while data := link.client.recv(65536):
                commit = _COMMIT_PUT.search(data)
                if commit:
                    with self.state.commits_seen.get_lock():
                        self.state.commits_seen.value += 1
                    lose = self.state.lose.value
                    if lose and lose in commit.group(1):
                        self.state.lose.value = b""
                        link.lose_answer = True
                        with self.state.answers_lost.get_lock():
                            self.state.answers_lost.value += 1
                if self.state.forget_conditions.value:
                    data = _IF_NONE_MATCH.sub(b"", data)
                link.upstream.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(link)

    def _answers(self, link: _Link) -> None:
        try:
            while data := link.upstream.recv(65536):
                if link.lose_answer:  # the server applied the commit and answered; nobody hears it
                    break
                link.client.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(link)

    def _drop(self, link: _Link) -> None:
        with self.lock:
            self.links.discard(link)
        link.close()


def _serve(port: int, target: tuple[str, int], state: _State) -> None:
    _Server(socket.create_server(("127.0.0.1", port)), target, state).serve()


class S3Proxy:
    """Forwards every connection to ``endpoint``, unless told otherwise:

    * ``forget_conditions``: drop the ``If-None-Match`` header, as a store without conditional
      writes would (a second put-if-absent of a key then succeeds);
    * ``down = True``: cut every open connection and close new ones at once, as a stopped
      server does; ``down = False`` brings it back;
    * ``lose_next_commit_answer(table_key)``: forward the next PUT of a Delta log file under
      ``table_key``, then cut the connection before its answer reaches the writer: the commit
      is applied, the writer does not know.
    """

    def __init__(self, endpoint: str, forget_conditions: bool = False) -> None:
        target = urlsplit(endpoint)
        self.port = free_port()
        ctx = multiprocessing.get_context("spawn")
        self._state = _State(ctx, forget_conditions)
        self._process = ctx.Process(
            target=_serve, args=(self.port, (target.hostname or "127.0.0.1", target.port or 80), self._state), daemon=True
        )

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def down(self) -> bool:
        return bool(self._state.down.value)

    @down.setter
    def down(self, value: bool) -> None:
        self._state.down.value = int(value)

    def lose_next_commit_answer(self, table_key: str) -> None:
        self._state.lose.value = table_key.encode()

    @property
    def commits_seen(self) -> int:
        return int(self._state.commits_seen.value)

    @property
    def answer_lost(self) -> bool:
        return self._state.answers_lost.value > 0

    def __enter__(self) -> S3Proxy:
        self._process.start()
        deadline = 30.0
        while deadline > 0:  # listening once a connection is accepted
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                threading.Event().wait(0.05)
                deadline -= 0.05
        raise RuntimeError(f"the S3 proxy on port {self.port} did not start")

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()  # by its PID
        self._process.join(10)


def delete_tree(location: Any) -> None:
    """Delete a folder of the lake and everything under it, local or on an object store
    (``location``: a ``storage.Location``, e.g. ``config.layout.sink``, or a local path)."""
    from offsetlake import storage

    fs, path = storage.filesystem(location)
    fs.delete_dir(path)


def delete_file(uri: str, options: Any = None) -> None:
    """Delete one file of the lake (a ``file://`` or object-store URI, or a local path), reached
    with ``options`` (the pipeline's ``config.layout.sink.options``) on an object store."""
    from offsetlake import storage

    fs, path = storage.filesystem(storage.Location(uri.removeprefix("file://") if uri.startswith("file://") else uri, options))
    fs.delete_file(path)
