"""A local Hugging Face Hub for the tests: the endpoints huggingface_hub's own client calls to push a folder, on
loopback only, written from the client's code (huggingface_hub 2.x: ``hf_api.py``, ``_commit_api.py``, ``lfs.py``).

- ``GET /api/whoami-v2``: the token's user (401 without a known token);
- ``POST /api/repos/create``, ``GET /api/models/{repo}/revision/{rev}``: repos (private or not), their info;
- ``GET /api/models/{repo}/refs``, ``POST`` / ``DELETE /api/models/{repo}/branch/{name}``: branches;
- ``POST /api/models/{repo}/preupload/{rev}``: each file's upload mode (``lfs`` for binary or large files, else
  ``regular``, with the blob id already there);
- ``POST /{repo}.git/info/lfs/objects/batch`` + ``PUT /lfs-upload/{oid}``: LFS's basic transfer (no upload action for
  an object already stored; an upload whose bytes do not hash to the oid is refused);
- ``POST /api/models/{repo}/commit/{rev}``: the NDJSON commit (files, LFS files, deletions); an LFS file never
  uploaded is refused;
- ``POST /api/models/{repo}/paths-info/{rev}``, ``GET /api/models/{repo}/tree/{rev}``: files with their git blob id
  and, for LFS files, the LFS sha256 and size;
- ``POST /api/validate-yaml``: a README's metadata accepted.

Tokens: ``WRITE_TOKEN`` may write, ``READ_TOKEN`` only read (403 on any write). `HubServer.commits` counts commits;
`HubServer.files(repo, rev)` is what a revision holds: path -> bytes. ``corrupt_lfs``: LFS uploads stored reversed.
The ``hub`` fixture (import it into a test module) gives a test its own server, the client pointed at nothing else.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import pytest

WRITE_TOKEN, READ_TOKEN = "hf_test_write", "hf_test_read"
USER = "tester"
LFS_THRESHOLD = 10 * 1024 * 1024


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class Stored:
    """A file at a commit: its bytes, and whether it is stored with LFS."""

    data: bytes
    lfs: bool

    def info(self, path: str) -> dict:
        entry = {"type": "file", "path": path, "size": len(self.data)}
        if self.lfs:
            sha = hashlib.sha256(self.data).hexdigest()
            pointer = lfs_pointer(sha, len(self.data))
            entry.update(oid=git_blob_id(pointer), lfs={"oid": sha, "size": len(self.data), "pointerSize": len(pointer)})
        else:
            entry["oid"] = git_blob_id(self.data)
        return entry


@dataclass
class Repo:
    private: bool
    commits: dict[str, dict[str, Stored]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)


class HubServer:
    """The server's state, and the server itself on 127.0.0.1 (a thread; `close` stops it)."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.commits = 0
        self.lfs_uploads = 0
        self.corrupt_lfs = False  # a faulty Hub: what an LFS upload stores is not what was sent
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def create_repo(self, repo_id: str, private: bool = False) -> None:
        root = uuid.uuid4().hex + uuid.uuid4().hex[:8]
        self.repos[repo_id] = Repo(private, {root: {".gitattributes": Stored(b"*.safetensors filter=lfs\n", False)}},
                                   {"main": root})

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return {path: stored.data for path, stored in repo.commits[repo.branches.get(revision, revision)].items()}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A `HubServer` for one test, huggingface_hub set to reach it (LFS, not Xet; online; no token unless the test
    gives one: no ``HF_TOKEN``, no stored login)."""
    import huggingface_hub.constants

    server = HubServer()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # the LFS protocol, as served here
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the suite is offline: this Hub is local
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-stored-token"))
    yield server
    server.close()


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        # -------------------------------------------------------------------------------- plumbing
        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                return self.rfile.read(length)
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return b""

        def _send(self, status: int, payload=None, error: str | None = None) -> None:
            body = json.dumps({"error": error} if error is not None else payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if error is not None:
                self.send_header("X-Error-Message", error)
            self.end_headers()
            self.wfile.write(body)

        def _token(self) -> str | None:
            auth = self.headers.get("Authorization", "")
            return auth[7:] if auth.startswith("Bearer ") else None

        def _may(self, write: bool) -> bool:
            token = self._token()
            if token not in (WRITE_TOKEN, READ_TOKEN):
                self._send(401, error="Invalid credentials in Authorization header")
                return False
            if write and token != WRITE_TOKEN:
                self._send(403, error="You don't have the rights to write to this repo")
                return False
            return True

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and self._token() not in (WRITE_TOKEN, READ_TOKEN)):
                self.send_response(404)
                body = b'{"error": "Repository not found"}'
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return None
            return repo

        def _commit_of(self, repo: Repo, revision: str) -> str | None:
            revision = unquote(revision)
            oid = repo.branches.get(revision, revision if revision in repo.commits else None)
            if oid is None:
                self.send_response(404)
                body = b'{"error": "Revision not found"}'
                self.send_header("X-Error-Code", "RevisionNotFound")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            return oid

        @staticmethod
        def _split(path: str, verb: str) -> tuple[str, str, str]:
            """``/api/models/ns/name/<verb>/rest`` -> (repo id, rest)."""
            head, _, rest = path.partition(f"/{verb}/")
            return head.removeprefix("/api/models/"), rest, head

        # -------------------------------------------------------------------------------- GET
        def do_GET(self) -> None:
            path = urlparse(self.path).path
            with hub.lock:
                if path == "/api/whoami-v2":
                    if self._may(write=False):
                        role = "write" if self._token() == WRITE_TOKEN else "read"
                        self._send(200, {"type": "user", "name": USER, "orgs": [],
                                         "auth": {"type": "access_token", "accessToken": {"role": role}}})
                    return
                if path.startswith("/api/models/") and path.endswith("/refs"):
                    repo = self._repo(path.removeprefix("/api/models/").removesuffix("/refs"))
                    if repo is not None:
                        self._send(200, {"branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": oid}
                                                      for n, oid in sorted(repo.branches.items())],
                                         "tags": [], "converts": []})
                    return
                if path.startswith("/api/models/") and (path.count("/") == 4 or "/revision/" in path):
                    repo_id, revision, _ = self._split(path, "revision") if "/revision/" in path else (
                        path.removeprefix("/api/models/"), "main", "")
                    repo = self._repo(repo_id)
                    oid = repo and self._commit_of(repo, revision)
                    if oid:
                        files = [{"rfilename": p} for p in sorted(repo.commits[oid])]
                        self._send(200, {"id": repo_id, "modelId": repo_id, "sha": oid, "private": repo.private,
                                         "siblings": files, "tags": [], "downloads": 0, "likes": 0})
                    return
                if path.startswith("/api/models/") and "/tree/" in path:
                    repo_id, rest, _ = self._split(path, "tree")
                    repo = self._repo(repo_id)
                    oid = repo and self._commit_of(repo, rest.split("/", 1)[0])
                    if oid:
                        self._send(200, [s.info(p) for p, s in sorted(repo.commits[oid].items())])
                    return
            self._send(404, error=f"no route GET {path}")

        # -------------------------------------------------------------------------------- PUT (LFS upload)
        def do_PUT(self) -> None:
            path = urlparse(self.path).path
            data = self._body()
            if not path.startswith("/lfs-upload/"):
                return self._send(404, error=f"no route PUT {path}")
            oid = path.rsplit("/", 1)[1]
            if hashlib.sha256(data).hexdigest() != oid:
                return self._send(400, error="the uploaded bytes do not hash to the oid")
            with hub.lock:
                hub.lfs[oid] = data[::-1] if hub.corrupt_lfs else data
                hub.lfs_uploads += 1
            self._send(200, {})

        # -------------------------------------------------------------------------------- DELETE
        def do_DELETE(self) -> None:
            path = urlparse(self.path).path
            with hub.lock:
                if path.startswith("/api/models/") and "/branch/" in path:
                    repo_id, name, _ = self._split(path, "branch")
                    repo = self._repo(repo_id)
                    if repo is not None and self._may(write=True):
                        if repo.branches.pop(unquote(name), None) is None:
                            return self._send(404, error="Branch not found")
                        self._send(200, {})
                    return
            self._send(404, error=f"no route DELETE {path}")

        # -------------------------------------------------------------------------------- POST
        def do_POST(self) -> None:
            url = urlparse(self.path)
            path, body = url.path, self._body()
            with hub.lock:
                if path == "/api/validate-yaml":
                    return self._send(200, {"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    if not self._may(write=True):
                        return
                    data = json.loads(body)
                    repo_id = f"{data.get('organization') or USER}/{data['name']}"
                    if repo_id in hub.repos:
                        return self._send(409, {"error": "You already created this model repo", "url":
                                                f"{hub.url}/{repo_id}"})
                    hub.create_repo(repo_id, bool(data.get("private")) or data.get("visibility") == "private")
                    return self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                if path.endswith(".git/info/lfs/objects/batch"):
                    repo = self._repo(path.removeprefix("/").removesuffix(".git/info/lfs/objects/batch"))
                    if repo is None or not self._may(write=True):
                        return
                    objects = []
                    for obj in json.loads(body)["objects"]:
                        entry = {"oid": obj["oid"], "size": obj["size"]}
                        if obj["oid"] not in hub.lfs:
                            entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"}}
                        objects.append(entry)
                    return self._send(200, {"transfer": "basic", "objects": objects})
                if not path.startswith("/api/models/"):
                    return self._send(404, error=f"no route POST {path}")
                for verb in ("preupload", "commit", "paths-info", "branch"):
                    if f"/{verb}/" in path:
                        repo_id, rest, _ = self._split(path, verb)
                        repo = self._repo(repo_id)
                        if repo is None:
                            return
                        self.repo_id = repo_id
                        return getattr(self, "_" + verb.replace("-", "_"))(repo, rest, body)
            self._send(404, error=f"no route POST {path}")

        def _preupload(self, repo: Repo, revision: str, body: bytes) -> None:
            if not self._may(write=True):
                return
            oid = self._commit_of(repo, revision)
            if oid is None:
                return
            files = []
            for item in json.loads(body)["files"]:
                sample = base64.b64decode(item["sample"])
                lfs = b"\0" in sample or item["size"] >= LFS_THRESHOLD
                there = repo.commits[oid].get(item["path"])
                files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                              "oid": there.info(item["path"])["oid"] if there is not None and not lfs else None})
            self._send(200, {"files": files, "commitOid": oid})

        def _commit(self, repo: Repo, revision: str, body: bytes) -> None:
            if not self._may(write=True):
                return
            parent = self._commit_of(repo, revision)
            if parent is None:
                return
            tree = dict(repo.commits[parent])
            for line in body.splitlines():
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "file":
                    tree[value["path"]] = Stored(base64.b64decode(value["content"]), False)
                elif key == "lfsFile":
                    if value["oid"] not in hub.lfs:
                        return self._send(422, error=f"LFS object {value['oid']} was never uploaded")
                    tree[value["path"]] = Stored(hub.lfs[value["oid"]], True)
                elif key == "deletedFile":
                    if tree.pop(value["path"], None) is None:
                        return self._send(404, error="A file with this name doesn't exist")
                elif key == "deletedFolder":
                    tree = {p: s for p, s in tree.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            oid = uuid.uuid4().hex + uuid.uuid4().hex[:8]
            repo.commits[oid] = tree
            repo.branches[unquote(revision)] = oid
            hub.commits += 1
            self._send(200, {"commitUrl": f"{hub.url}/{self.repo_id}/commit/{oid}", "commitOid": oid, "success": True})

        def _paths_info(self, repo: Repo, revision: str, body: bytes) -> None:
            oid = self._commit_of(repo, revision)
            if oid is None:
                return
            form = parse_qs(body.decode())
            tree = repo.commits[oid]
            self._send(200, [tree[p].info(p) for p in form.get("paths", []) if p in tree])

        def _branch(self, repo: Repo, name: str, body: bytes) -> None:
            if not self._may(write=True):
                return
            name = unquote(name)
            if name in repo.branches:
                return self._send(409, error=f"Reference already exists: refs/heads/{name}")
            start = (json.loads(body) if body else {}).get("startingPoint") or "main"
            oid = self._commit_of(repo, start)
            if oid is not None:
                repo.branches[name] = oid
                self._send(200, {})

    return Handler
