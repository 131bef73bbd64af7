"""Push a release (or a merged folder) to the Hugging Face Hub, one revision per step, with huggingface_hub's own
client, and verify what the Hub holds against the manifest.

Contract of `push_folder`:
- What is pushed: every file the release's ``manifest.json`` lists (the model card among them) and the manifest
  itself; never ``_COMPLETE`` or the publishers' claims (``_PUBLISHING/``). A merged folder without a manifest
  (``stepmerge merge``'s output) pushes the files its ``stepmerge.json`` lists, and that record. A folder that is
  neither (or a release whose marker does not hold its manifest's sha256) is refused: `ReleaseIncomplete`.
- Where: ``repo_id`` at ``revision`` (a branch; default ``main``), created from ``main`` when missing; the revision
  holds exactly the release afterwards (files of an earlier push that the release lacks are deleted in the same
  commit). ``moving_refs`` (e.g. ``latest``) are pointed at the commit afterwards.
- How: one ``create_commit`` whose large files are pre-uploaded by the client, many in flight
  (``num_threads``); an object the Hub already stores is not uploaded again, so a push interrupted and run again
  sends only what is missing.
- Idempotent: when the revision's ``manifest.json`` (the record pushed last, in the same commit as the files) is
  this one's and the files check out, nothing is committed (``committed`` False).
- Verified after the push, without downloading a weight: the Hub's own metadata of every file
  (``get_paths_info(expand=True)``: the LFS sha256 and size of a large file, the git blob id of a small one)
  against the manifest's sha256 and sizes (small files' blob ids computed from the local bytes); the revision
  holds no other file. A mismatch is `HubPushUnverified`: the push is not reported as done.
- Refusals, each one named line (`HubPushRefused`), nothing presented as pushed: no token, a token the Hub
  refuses, no write access to the repo, a repo that does not exist without ``private`` (which creates it private),
  the Hub out of reach.
- The token: ``token``, else huggingface_hub's own (``HF_TOKEN``, then the stored login).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from merge_engine import storage
from merge_engine.errors import HubPushRefused, HubPushUnverified, ReleaseIncomplete
from merge_engine.release.folders import MANIFEST, MARKER
from merge_engine.release.manifest import released_manifest

PROVENANCE = "stepmerge.json"  # a merged folder's record (`merge_engine.output.target.PROVENANCE_FILE`)
DEFAULT_REVISION = "main"
NUM_THREADS = 8


@dataclass(frozen=True)
class PushedFile:
    """A file to push: its path in the release (and the repo), size and sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class HubPush:
    """What a push did: ``commit`` the revision's commit after it (a new one when ``committed``)."""

    repo_id: str
    revision: str
    commit: str
    committed: bool
    files: int
    total_bytes: int
    moved_refs: tuple[str, ...] = ()

    def summary(self) -> str:
        done = "pushed" if self.committed else "already on the Hub (no commit)"
        refs = f"; {', '.join(self.moved_refs)} -> it" if self.moved_refs else ""
        return (f"{self.repo_id}@{self.revision}: {done}, {self.files} files, {self.total_bytes / 1e6:.1f} MB, "
                f"commit {self.commit[:12]}, verified against the manifest{refs}")


def git_blob_id(data: bytes) -> str:
    """The git blob id (sha1 of ``blob <size>\\0`` + bytes) the Hub gives a small file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def files_to_push(folder: str) -> tuple[list[PushedFile], str]:
    """(the files to push, the record listing them: ``manifest.json`` or ``stepmerge.json``) of ``folder``; the
    record is the last of the files. `ReleaseIncomplete` when the folder has neither a manifest its marker matches nor a
    merged folder's record with every sha256."""
    listing = {e.path for e in storage.list_files(folder)}
    if MANIFEST in listing or MARKER in listing:
        manifest = released_manifest(folder)
        if manifest is None:
            raise ReleaseIncomplete("no valid _COMPLETE marker: not a release to push", folder)
        data = storage.read_bytes(storage.join(folder, MANIFEST))
        files = [PushedFile(f.path, f.size, f.sha256) for f in manifest.files]
        return files + [PushedFile(MANIFEST, len(data), hashlib.sha256(data).hexdigest())], MANIFEST
    from merge_engine.output.target import read_provenance

    record = read_provenance(folder)
    sizes = (record or {}).get("files")
    sums = (record or {}).get("sha256")
    if not isinstance(sizes, dict) or not isinstance(sums, dict) or set(sizes) - set(sums):
        raise ReleaseIncomplete(f"neither a release ({MANIFEST}) nor a merged folder whose {PROVENANCE} records "
                                "every file's sha256: nothing to push", folder)
    data = storage.read_bytes(storage.join(folder, PROVENANCE))
    files = [PushedFile(name, int(size), str(sums[name])) for name, size in sorted(sizes.items())]
    return files + [PushedFile(PROVENANCE, len(data), hashlib.sha256(data).hexdigest())], PROVENANCE


@contextlib.contextmanager
def _local_folder(folder: str, files: Sequence[PushedFile]) -> Iterator[str]:
    """A local path holding ``files``: the folder itself, or a temporary copy of an object-store folder."""
    if storage.is_local(folder):
        yield storage.local_path(folder)
        return
    with tempfile.TemporaryDirectory(prefix="stepmerge-push-") as local:
        for f in files:
            storage.copy_file(storage.join(folder, f.path), os.path.join(local, *f.path.split("/")))
        yield local


def _refusal(exc: Exception, repo_id: str, endpoint: str) -> HubPushRefused:
    """One named line for what the Hub (or the way to it) answered; ``transient`` when the Hub was out of reach or
    answered 429 or 5xx (the same push may succeed later)."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if isinstance(exc, RepositoryNotFoundError):
        return HubPushRefused(f"{repo_id} does not exist on the Hub (or this token may not see it)", repo_id)
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status == 401:
            return HubPushRefused("the Hub refused the token (401): set a valid HF_TOKEN", repo_id)
        if status == 403:
            return HubPushRefused(f"the token has no write access to {repo_id} (403)", repo_id)
        refused = HubPushRefused(f"the Hub answered {status}: {str(exc).splitlines()[0]}", repo_id)
        refused.transient = status == 429 or status >= 500
        return refused
    refused = HubPushRefused(f"cannot reach the Hub at {endpoint}: {type(exc).__name__}: {exc}", repo_id)
    refused.transient = True
    return refused


def _verify(api: Any, repo_id: str, commit: str, local: str, files: Sequence[PushedFile]) -> list[str]:
    """What differs between the commit and ``files`` (see the module docstring); empty when it holds them."""
    from huggingface_hub import RepoFile

    expected = {f.path: f for f in files}
    infos = {i.path: i for i in api.get_paths_info(repo_id, sorted(expected), revision=commit, expand=True)
             if isinstance(i, RepoFile)}
    problems = [f"{path}: not on the Hub" for path in sorted(set(expected) - set(infos))]
    for path, info in sorted(infos.items()):
        want = expected[path]
        if info.lfs is not None:
            if (info.lfs.sha256, info.lfs.size) != (want.sha256, want.size):
                problems.append(f"{path}: the Hub's LFS sha256 {info.lfs.sha256[:12]}… / {info.lfs.size} bytes, "
                                f"the manifest's {want.sha256[:12]}… / {want.size}")
            continue
        with open(os.path.join(local, *path.split("/")), "rb") as handle:
            data = handle.read()
        if hashlib.sha256(data).hexdigest() != want.sha256:
            problems.append(f"{path}: the local file no longer has the manifest's sha256")
        elif info.blob_id != git_blob_id(data) or info.size != want.size:
            problems.append(f"{path}: the Hub's blob {info.blob_id[:12]}… is not the manifest's bytes")
    held = {p for p in api.list_repo_files(repo_id, revision=commit)} - {".gitattributes"}
    problems += [f"{path}: on the Hub, not in the release" for path in sorted(held - set(expected))]
    return problems


def push_folder(folder: str, repo_id: str, *, revision: str | None = None, private: bool = False,
                token: str | None = None, moving_refs: Sequence[str] = (), endpoint: str | None = None,
                num_threads: int = NUM_THREADS) -> HubPush:
    """Push ``folder`` (a release, or a merged folder) to ``repo_id`` at ``revision``; see the module docstring.

    Raises `ReleaseIncomplete` (nothing to push), `HubPushRefused` (one line: no token, refused token, no write
    access, no such repo without ``private``, Hub out of reach), `HubPushUnverified` (the Hub's files are not the
    manifest's after the push)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    files, record = files_to_push(folder)
    token = token or get_token()
    api = HfApi(endpoint=endpoint, token=token or False)
    where = api.endpoint
    if not token:
        raise HubPushRefused("no Hugging Face token: set HF_TOKEN (or give the flow a Secret block)", repo_id)
    branch = revision or DEFAULT_REVISION
    try:
        api.whoami()
        if not api.repo_exists(repo_id):
            if not private:
                raise HubPushRefused(f"{repo_id} does not exist on the Hub: create it, or pass --private to create "
                                     "it as a private repo", repo_id)
            api.create_repo(repo_id, private=True, exist_ok=True)
        branches = {b.name for b in api.list_repo_refs(repo_id).branches}
        if branch not in branches:
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        with _local_folder(folder, files) as local:
            head = api.repo_info(repo_id, revision=branch).sha or branch  # no sha given: the branch's head
            committed = bool(_verify(api, repo_id, head, local, files))
            if committed:
                held = set(api.list_repo_files(repo_id, revision=branch)) - {".gitattributes"}
                operations: list[Any] = [CommitOperationDelete(path) for path in sorted(held - {f.path for f in files})]
                operations += [CommitOperationAdd(f.path, os.path.join(local, *f.path.split("/"))) for f in files]
                title = f"stepmerge: {os.path.basename(folder.rstrip('/')) or folder} ({record})"
                head = api.create_commit(repo_id, operations, commit_message=title, revision=branch,
                                         num_threads=num_threads).oid
                problems = _verify(api, repo_id, head, local, files)
                if problems:
                    raise HubPushUnverified(f"{len(problems)} file(s) differ on the Hub after the push: "
                                            + "; ".join(problems[:5]), f"{repo_id}@{branch}")
        moved = []
        for ref in moving_refs:
            if ref == branch:
                continue
            if ref in {b.name for b in api.list_repo_refs(repo_id).branches}:
                api.delete_branch(repo_id, branch=ref)
            api.create_branch(repo_id, branch=ref, revision=head)
            moved.append(ref)
    except (HubPushRefused, HubPushUnverified):
        raise
    except (HfHubHTTPError, OSError) as exc:
        raise _refusal(exc, repo_id, where) from exc
    except Exception as exc:  # the client's transport errors (httpx) are no OSError
        if type(exc).__module__.startswith(("httpx", "httpcore", "requests", "urllib3")):
            raise _refusal(exc, repo_id, where) from exc
        raise
    return HubPush(repo_id, branch, head, committed, len(files), sum(f.size for f in files), tuple(moved))


__all__ = ["HubPush", "PushedFile", "files_to_push", "git_blob_id", "push_folder"]
