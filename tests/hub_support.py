"""A local stand-in for the Hugging Face hub's HTTP API, answering the calls huggingface_hub makes:
model info with file sizes (GET /api/models/ORG/NAME[/revision/REV]), and file metadata and download
(HEAD/GET /ORG/NAME/resolve/REV/PATH, with ETag / X-Linked-Etag / X-Repo-Commit, Range and 206).
It answers whatever commit and file list a test gives a repository (`Repo.sha`, `Repo.listing`), can
drop a connection mid-file, gate a repository (401 without the right token) and counts the
requests and bytes it served, so tests see exactly what a pull fetched."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

TOKEN = "hf_test_token"


@dataclass
class Repo:
    files: dict[str, Path]  # repository path -> file on disk served for it
    sha: str = ""  # any text: the commit the hub answers (a test may give a hostile one)
    gated: bool = False
    listing: dict[str, int] | None = None  # extra paths (-> size) listed but not served: any names a test gives

    def __post_init__(self):
        if not self.sha:
            h = hashlib.sha1(json.dumps(sorted((k, str(v)) for k, v in self.files.items())).encode())
            self.sha = h.hexdigest()


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    ranges: list[tuple[str, str]] = field(default_factory=list)  # (path, Range header) of resumed GETs
    served: Counter = field(default_factory=Counter)  # (repo, file) -> bytes sent in bodies
    drops: dict[tuple[str, str], int] = field(default_factory=dict)  # (repo, file) -> connections to cut
    url: str = ""
    cut_at: int = 0  # bytes sent before a dropped connection is cut (0: half the body)
    _etags: dict = field(default_factory=dict)

    def etag(self, path: Path) -> str:
        key = (str(path), path.stat().st_mtime_ns)
        if key not in self._etags:
            self._etags[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        return self._etags[key]

    def reset(self) -> None:
        self.requests.clear()
        self.ranges.clear()
        self.served.clear()
        self.drops.clear()
        self.cut_at = 0

    def downloads(self) -> list[str]:
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict | None = None):
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, code: int, error_code: str):
            self._send(code, json.dumps({"error": error_code}).encode(),
                       {"X-Error-Code": error_code, "Content-Type": "application/json"})

        def _repo(self, repo_id: str):
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound")
                return None
            if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._error(401, "GatedRepo")
                return None
            return repo

        def do_HEAD(self):
            self._serve()

        def do_GET(self):
            self._serve()

        def _serve(self):
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                repo = self._repo(m.group(1))
                if repo is None:
                    return
                if m.group(2) not in (None, "main", repo.sha):
                    return self._error(404, "RevisionNotFound")
                siblings = [{"rfilename": k, "size": v.stat().st_size, "blobId": hub.etag(v)[:40],
                             "lfs": {"size": v.stat().st_size, "sha256": hub.etag(v), "pointerSize": 134}}
                            for k, v in sorted(repo.files.items())]
                siblings += [{"rfilename": k, "size": int(n)} for k, n in sorted((repo.listing or {}).items())]
                body = json.dumps({"id": m.group(1), "modelId": m.group(1), "sha": repo.sha,
                                   "siblings": siblings, "private": False, "gated": repo.gated}).encode()
                return self._send(200, body, {"Content-Type": "application/json"})
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._error(404, "NotFound")
            repo = self._repo(m.group(1))
            if repo is None:
                return
            if m.group(2) not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound")
            src = repo.files.get(m.group(3))
            if src is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha})
            data = src.read_bytes()
            start = 0
            rng = self.headers.get("Range")
            head = {"X-Repo-Commit": repo.sha, "ETag": f'"{hub.etag(src)}"', "X-Linked-Etag": f'"{hub.etag(src)}"',
                    "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes",
                    "Content-Type": "application/octet-stream"}
            if self.command == "GET" and rng:
                hub.ranges.append((m.group(3), rng))
                start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
                head["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            key = (m.group(1), m.group(3))
            if self.command == "GET" and hub.drops.get(key, 0) > 0:
                hub.drops[key] -= 1  # promise the whole body, send a part, cut the connection
                self.send_response(206 if rng else 200)
                for k, v in head.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                part = body[: hub.cut_at or max(1, len(body) // 2)]
                self.wfile.write(part)
                self.wfile.flush()
                hub.served[key] += len(part)
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            if self.command == "GET":
                hub.served[key] += len(body)
            self._send(206 if rng and self.command == "GET" else 200, body, head)

    return Handler


def start_hub(hub: Hub):
    """Serve `hub` on a free local port in a daemon thread; -> the server (call .shutdown())."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
