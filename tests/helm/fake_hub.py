"""A tiny Hugging Face Hub on 127.0.0.1 (OS-chosen port) for the model-source tests.

Why a server and not a prepopulated cache with ``local_files_only``: on a cluster the
chart's init container downloads over HTTP, and that is the path worth testing: revision
resolution, the file listing, ``allow``/``ignore`` filtering, the token sent as a bearer
header, and how a missing or private repository surfaces. An offline cache lookup would
exercise none of it. The server speaks only the endpoints ``huggingface_hub.snapshot_download``
calls (checked against huggingface_hub 2.4): repo info, the recursive tree listing, and
HEAD/GET on ``resolve`` URLs, with plain HTTP (no Xet) downloads.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    token: str | None = None  # set: private, readable only with this bearer token
    commit: str = field(default_factory=lambda: hashlib.sha1(b"pdserve").hexdigest())


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    url: str = ""
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, auth


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def _reply(self, status: int, data: bytes, headers: dict[str, str], *, body: bool) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _json(self, obj: object, *, body: bool) -> None:
            self._reply(
                200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, body=body
            )

        def _serve(self, *, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            auth = self.headers.get("Authorization")
            hub.requests.append((self.command, path, auth))
            found = self._find(path)
            if found is None:
                self._reply(404, b"{}", {"X-Error-Code": "RepoNotFound"}, body=body)
                return
            repo_id, repo, rest = found
            if repo.token is not None and auth != f"Bearer {repo.token}":
                # What the Hub answers for a private repository without a valid token.
                self._reply(401, b"{}", {"X-Error-Code": "RepoNotFound"}, body=body)
                return
            kind, _, tail = rest.partition("/")
            if kind == "revision":
                siblings = [{"rfilename": name} for name in sorted(repo.files)]
                self._json({"id": repo_id, "sha": repo.commit, "siblings": siblings}, body=body)
            elif kind == "tree":
                tree = [
                    {
                        "type": "file",
                        "path": name,
                        "size": len(data),
                        "oid": hashlib.sha1(data).hexdigest(),
                    }
                    for name, data in sorted(repo.files.items())
                ]
                self._json(tree, body=body)
            elif kind == "resolve":
                _revision, _, filename = tail.partition("/")
                data = repo.files.get(filename)
                if data is None:
                    self._reply(404, b"{}", {"X-Error-Code": "EntryNotFound"}, body=body)
                    return
                headers = {
                    "X-Repo-Commit": repo.commit,
                    "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                    "Content-Type": "application/octet-stream",
                }
                self._reply(200, data, headers, body=body)
            else:
                self._reply(404, b"{}", {}, body=body)

        def _find(self, path: str) -> tuple[str, FakeRepo, str] | None:
            # /api/models/<org>/<name>/(revision|tree)/<rev>  or  /<org>/<name>/resolve/<rev>/<file>
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                parts = parts[2:]
                repo_id, rest = "/".join(parts[:2]), "/".join(parts[2:])
            else:
                repo_id, rest = "/".join(parts[:2]), "/".join(parts[2:])
            repo = hub.repos.get(repo_id)
            return None if repo is None else (repo_id, repo, rest)

    return Handler


@contextmanager
def serve_fake_hub(repos: dict[str, FakeRepo]) -> Iterator[FakeHub]:
    hub = FakeHub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
