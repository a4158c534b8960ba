"""The local web: a real HTTP server on loopback that serves a corpus's pages and its search API.

Routes: ``GET <page path>`` -> the page's HTML (404 if absent); ``GET /search?q=...&k=...`` -> JSON
``{"query", "results": [{rank, url, title, snippet, score}]}``; ``GET /healthz`` -> ``ok``.
The server binds 127.0.0.1 on a port the OS picks and answers each request on a bounded thread
pool (HTTP/1.0, one request per connection, socket timeout), so a burst of concurrent episodes
queues in the kernel backlog instead of spawning unbounded threads. `shared_server(built)` starts
one server per corpus per process — in a child process, off the GIL of the episode threads —
shared by every episode, stopped at interpreter exit (and when its parent dies).

`BrowseClient` is the host-side fetcher the tools use (plain `http.client`, so proxy environment
variables can never route loopback traffic elsewhere). The agent never talks to the server: its
tool calls are Python methods on the environment that call the client. No sandboxing here.
"""
from __future__ import annotations

import atexit
import http.client
import ipaddress
import json
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from envs.browse.build import BuiltCorpus
from envs.browse.corpus import Corpus, check_path
from envs.browse.index import SearchError, SearchHit, SearchIndex
from jointrl.paths import REPO_ROOT

log = logging.getLogger(__name__)


class FetchError(RuntimeError):
    """The local web server could not be reached or answered with an error."""


class _Handler(BaseHTTPRequestHandler):
    server_version = "jointrl-browse/1"
    protocol_version = "HTTP/1.0"
    timeout = 10  # seconds a client may take to send its request line (slow clients can't pin a worker)

    def log_message(self, fmt, *args):  # the default writes every request to stderr
        pass

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        srv: "_PooledServer" = self.server  # type: ignore[assignment]
        parts = urlsplit(self.path)
        if parts.path == "/healthz":
            return self._send(200, b"ok", "text/plain")
        if parts.path == "/search":
            qs = parse_qs(parts.query)
            try:
                k = int(qs.get("k", ["10"])[0])
                hits = srv.index.search(qs.get("q", [""])[0], k)
            except (SearchError, ValueError) as e:
                return self._send(400, json.dumps({"error": str(e)}).encode(), "application/json")
            body = {"query": qs.get("q", [""])[0],
                    "results": [{"rank": h.rank, "url": h.path, "title": h.title, "snippet": h.snippet, "score": h.score}
                                for h in hits]}
            return self._send(200, json.dumps(body).encode(), "application/json")
        try:
            page = srv.corpus.page(check_path(parts.path))
        except KeyError:
            return self._send(404, f"no page at {parts.path}".encode(), "text/plain")
        self._send(200, page.html.encode("utf-8"), "text/html; charset=utf-8")


class _PooledServer(HTTPServer):
    """HTTPServer that hands connections to a fixed thread pool, with at most `max_pending` in flight."""

    request_queue_size = 256
    allow_reuse_address = True

    def __init__(self, addr, corpus: Corpus, index: SearchIndex, max_workers: int, max_pending: int):
        super().__init__(addr, _Handler)
        self.corpus, self.index = corpus, index
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="browse-http")
        self.slots = threading.BoundedSemaphore(max_pending)

    def process_request(self, request, client_address):
        self.slots.acquire()  # back-pressure: when full, the accept loop waits and the kernel queues
        self.pool.submit(self._work, request, client_address)

    def _work(self, request, client_address):
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request, client_address):  # a client that hung up is not our error
        pass

    def server_close(self):
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _child_main() -> None:
    """`python -m envs.browse.server`: read (corpus, index path, ...) as a pickle on stdin, print the
    port on stdout, serve until stdin reaches EOF (the parent closed it, or died: no orphans)."""
    import pickle
    import struct
    import sys

    stdin = sys.stdin.buffer
    (size,) = struct.unpack("!Q", stdin.read(8))
    corpus, index_path, host, port, max_workers, max_pending = pickle.loads(stdin.read(size))
    try:
        srv = _PooledServer((host, port), corpus, SearchIndex(index_path), max_workers, max_pending)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return

    def watch_parent() -> None:
        stdin.read()  # blocks until EOF
        srv.shutdown()

    threading.Thread(target=watch_parent, daemon=True).start()
    print(json.dumps({"host": srv.server_address[0], "port": srv.server_address[1]}), flush=True)
    srv.serve_forever(poll_interval=0.2)
    srv.server_close()


class BrowseServer:
    """A started HTTP server for one corpus. Use as a context manager, or `shared_server` per process.

    process=True runs the server in a child Python process (`python -m envs.browse.server`): request
    handling then never competes for the GIL with the threads that step episodes, which matters with
    dozens of concurrent episodes (docs/browse.md has the measured difference). The corpus object is
    pickled to the child, so it must be picklable (DiskCorpus and DirectoryCorpus are). The child
    exits when its stdin closes, i.e. on `close()` or when this process dies. process=False serves
    from a thread of this process (any corpus object).
    """

    def __init__(self, corpus: Corpus, index: SearchIndex, host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 8, max_pending: int = 128, process: bool = False, start_timeout_s: float = 60.0):
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"BrowseServer binds loopback only; refusing host {host!r}")
        if max_workers < 1 or max_pending < max_workers:
            raise ValueError(f"need 1 <= max_workers <= max_pending, got {max_workers}, {max_pending}")
        self.closed = False
        self.process: subprocess.Popen | None = None
        self._srv = None
        self._thread = None
        self.max_workers = max_workers
        if process:
            self.host, self.port = self._start_child(corpus, index, host, port, max_workers, max_pending, start_timeout_s)
        else:
            self._srv = _PooledServer((host, port), corpus, index, max_workers, max_pending)
            self.host, self.port = self._srv.server_address[:2]
            self._thread = threading.Thread(target=self._srv.serve_forever, kwargs={"poll_interval": 0.2},
                                            name=f"browse-server:{self.port}", daemon=True)
            self._thread.start()

    def _start_child(self, corpus, index, host, port, max_workers, max_pending, timeout_s) -> tuple[str, int]:
        try:
            payload = pickle.dumps((corpus, str(index.db_path), host, port, max_workers, max_pending))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"corpus {type(corpus).__name__} cannot be sent to a server process ({e}); "
                            "make it picklable or serve it with process=False") from e
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        self.process = subprocess.Popen([sys.executable, "-m", "envs.browse.server"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, cwd=str(REPO_ROOT))
        self.process.stdin.write(struct.pack("!Q", len(payload)) + payload)
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else b""
        try:
            info = json.loads(line)
        except ValueError:
            info = {"error": f"no answer within {timeout_s} s (exit code {self.process.poll()})"}
        if "error" in info:
            self.close()
            raise RuntimeError(f"browse server process failed to start: {info['error']}")
        return info["host"], int(info["port"])

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.process is not None:
            try:
                self.process.stdin.close()  # EOF: the child shuts its server down and exits
            except OSError:
                pass
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # our own child, by handle
                self.process.kill()
                self.process.wait(timeout=5)
            self.process.stdout.close()
        if self._srv is not None:
            self._srv.shutdown()
            self._srv.server_close()
            self._thread.join(timeout=5)

    def __enter__(self) -> "BrowseServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SHARED: dict[str, BrowseServer] = {}
_SHARED_LOCK = threading.Lock()


def shared_server(built: BuiltCorpus) -> BrowseServer:
    """The one server of this process for `built`, in its own process (started on first call)."""
    key = str(built.index_path.resolve())
    with _SHARED_LOCK:
        srv = _SHARED.get(key)
        if srv is None or srv.closed:
            try:
                srv = BrowseServer(built.corpus, SearchIndex(built.index_path), process=True)
            except TypeError as e:  # an unpicklable corpus still works, served from a thread
                log.warning("serving corpus %s from a thread of this process: %s", built.corpus.name, e)
                srv = BrowseServer(built.corpus, SearchIndex(built.index_path), process=False)
            _SHARED[key] = srv
        return srv


@atexit.register
def _close_shared() -> None:
    with _SHARED_LOCK:
        for srv in _SHARED.values():
            srv.close()
        _SHARED.clear()


# ----------------------------------------------------------------------------- client
@dataclass(frozen=True)
class Fetched:
    status: int
    body: str


class BrowseClient:
    """Host-side HTTP client for a BrowseServer (one short connection per request)."""

    def __init__(self, host: str, port: int, timeout_s: float = 10.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s

    @staticmethod
    def for_server(server: BrowseServer, timeout_s: float = 10.0) -> "BrowseClient":
        return BrowseClient(server.host, server.port, timeout_s)

    def get(self, target: str) -> Fetched:
        con = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            con.request("GET", target)
            resp = con.getresponse()
            return Fetched(resp.status, resp.read().decode("utf-8", errors="replace"))
        except (OSError, http.client.HTTPException) as e:
            raise FetchError(f"local web server {self.host}:{self.port} failed on {target!r}: {e}") from e
        finally:
            con.close()

    def page(self, path: str) -> Fetched:
        return self.get(quote(path, safe="/-._~"))

    def search(self, query: str, k: int) -> list[SearchHit]:
        r = self.get(f"/search?q={quote(query, safe='')}&k={int(k)}")
        data = json.loads(r.body)
        if r.status != 200:
            raise SearchError(data.get("error", f"search failed with HTTP {r.status}"))
        return [SearchHit(rank=d["rank"], path=d["url"], title=d["title"], snippet=d["snippet"], score=d["score"])
                for d in data["results"]]


if __name__ == "__main__":
    _child_main()
