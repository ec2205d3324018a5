"""A local stand-in for the parts of the Hugging Face Hub's HTTP API the project reaches (selected with HF_ENDPOINT).

Strict: it answers only the requests it knows, the way the Hub answers them (status, JSON shape, the headers
huggingface_hub reads), and fails loudly on anything else, so a test shows what is missing. Each repository is
a folder under `root` (`datasets/ORG/NAME/...`, `models/ORG/NAME/...`) holding its files at the head of `main`;
which files are in LFS and the commit history live beside it in memory. What it answers:

    GET  /api/whoami-v2                              who a token belongs to, and their organisations
    GET  /api/agent-harnesses                        the registry huggingface_hub names its client from (empty)
    POST /api/repos/create                           a repository with the Hub's first commit (.gitattributes)
    GET  /api/{models,datasets}/ORG/NAME[/revision/R]   repository info (sha, siblings)
    GET  /api/.../tree/R[/PATH]                      the listing, with git blob ids and LFS sha256, paginated
                                                     (Link: rel="next", `page_size` entries a page)
    POST /api/validate-yaml                          the card's YAML header is checked before a commit
    POST /api/.../preupload/R                        regular or LFS, and the oid of the file there now
    POST /[datasets/]ORG/NAME.git/info/lfs/objects/batch   LFS batch API, basic transfer, to the storage server
    POST /[datasets/]ORG/NAME.git/info/lfs/objects/verify  after an upload
    POST /api/.../commit/R                           NDJSON: header, file, lfsFile, deletedFile, deletedFolder
    HEAD|GET /[datasets/]ORG/NAME/resolve/R/PATH     regular files here (ETag = git blob id, ranges); LFS files
                                                     redirect to the storage server (X-Linked-Etag = sha256,
                                                     X-Linked-Size), as the Hub redirects to its CDN

LFS objects live on a second server (another origin, as the Hub's storage is): PUT to the signed upload URL the
batch API hands out, GET/HEAD with HTTP ranges. Only `main` (and its head commit's id) is a revision, and the
Xet protocol is not spoken: clients run with HF_HUB_DISABLE_XET=1 (`environ()`), and a Xet request fails loudly.

A test's client runs in a process of its own (`ttt` through conftest.run_ttt, or `run_client` for a snippet):
huggingface_hub reads HF_ENDPOINT when it is imported. Faults a test can ask for: `rate_limit(route, times)`
answers 429 with Retry-After; `drop_commits_after(files)` closes the connection, without an answer, on every
commit once that many files have been committed. Every request is recorded in `log` (method, path, status, body
bytes sent and received), which is how a test counts the bytes served.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import NoReturn
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

# The LFS rules of the .gitattributes the Hub writes into a new repository (the part that concerns this project).
GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in ("*.bin", "*.ckpt", "*.npy", "*.parquet", "*.pickle", "*.pkl", "*.pt", "*.pth", "*.safetensors")
)
Answer = tuple[int, dict, bytes]  # status, headers, body
Route = Callable[["Request"], Answer]  # what answers an origin's requests
LFS_MIN_SIZE = 10 * 1024 * 1024  # bigger files go to LFS whatever their name
HUB_PAGE_SIZE = 1000  # tree entries per page on the Hub
REPO_TYPES = {"models": "model", "datasets": "dataset"}
INVALID_TOKEN = "Invalid credentials in Authorization header"
LFS_JSON = "application/vnd.git-lfs+json"
# ada may write to her organisation ttt-org; eve only to her own namespace.
ACCOUNTS = {"hf_ada": ("ada", ["ttt-org"]), "hf_eve": ("eve", [])}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """What git stores for an LFS file: the Hub's ETag of an LFS file is this pointer's blob id."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class HubRefusal(Exception):
    """An answer other than 2xx, as the Hub words it: the status, the message (in the X-Error-Message header and
    the body's "error"), X-Error-Code where the Hub sets one, and any other headers or body fields."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None, **fields: object
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers, self.fields = status, message, code, headers or {}, fields

    def answer(self) -> Answer:
        headers = {"Content-Type": "application/json", "X-Error-Message": self.message, **self.headers}
        if self.code:
            headers["X-Error-Code"] = self.code
        return self.status, headers, json.dumps({"error": self.message, **self.fields}).encode()


class DropConnection(Exception):
    """Close the connection without an answer, as a network that fails mid-request does."""


class Unimplemented(HubRefusal):
    """A request the stand-in does not implement: answered 501, noted, and a failure of the test at the end."""


@dataclass
class Commit:
    oid: str
    summary: str
    added: list[str]
    deleted: list[str]


@dataclass
class Repo:
    kind: str  # "model" or "dataset"
    repo_id: str
    folder: Path
    lfs: dict[str, str] = field(default_factory=dict)  # path -> sha256, for the files stored in LFS
    commits: list[Commit] = field(default_factory=list)

    @property
    def url_prefix(self) -> str:
        return "datasets/" if self.kind == "dataset" else ""

    @property
    def head(self) -> str:
        return self.commits[-1].oid

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*") if p.is_file())

    def entry(self, path: str) -> dict:
        """A file's or folder's entry as the tree endpoint lists it."""
        target = self.folder / path
        if target.is_dir():
            inside = sorted(p.relative_to(self.folder).as_posix() for p in target.rglob("*") if p.is_file())
            tree_id = hashlib.sha1("".join(self.entry(p)["oid"] for p in inside).encode()).hexdigest()
            return {"type": "directory", "oid": tree_id, "size": 0, "path": path}
        size = target.stat().st_size
        if path not in self.lfs:
            return {"type": "file", "oid": git_blob_id(target.read_bytes()), "size": size, "path": path}
        sha256 = self.lfs[path]
        pointer = lfs_pointer(sha256, size)
        lfs = {"oid": sha256, "size": size, "pointerSize": len(pointer)}
        return {"type": "file", "oid": git_blob_id(pointer), "size": size, "path": path, "lfs": lfs}

    def is_lfs(self, path: str, size: int, sample: bytes) -> bool:
        """The Hub's rule: an LFS pattern of the repository's .gitattributes, a big file, or a binary one."""
        attributes = self.folder / ".gitattributes"
        patterns = [
            line.split()[0]
            for line in (attributes.read_text().splitlines() if attributes.is_file() else [])
            if "filter=lfs" in line
        ]
        name = PurePosixPath(path).name
        return any(fnmatch.fnmatch(name, p) for p in patterns) or size >= LFS_MIN_SIZE or b"\0" in sample


@dataclass
class Served:
    method: str
    path: str
    query: str
    status: int
    sent: int  # body bytes of the answer
    received: int  # body bytes of the request
    range: str | None = None


class RepoStorage:
    """The repositories' contents: a folder per repository under `root` (`datasets/ORG/NAME/...`) holding its files
    at the head of `main`, its LFS paths and commits in memory, and every LFS object uploaded, committed or not, by
    sha256 in `root/.lfs`. `lock` guards them against the servers' threads."""

    def __init__(self, root: Path, lock: threading.RLock) -> None:
        self.root = root
        self.lock = lock
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs_store = self.root / ".lfs"
        self.lfs_store.mkdir(parents=True, exist_ok=True)

    def get(self, kind: str, repo_id: str) -> Repo | None:
        return self.repos.get((kind, repo_id))

    def create(self, kind: str, repo_id: str, files: dict[str, bytes] | None = None) -> Repo:
        """A repository as the Hub creates it, then one commit of `files` (stored in LFS by the Hub's rule)."""
        with self.lock:
            folder = self.root / f"{kind}s" / repo_id
            folder.mkdir(parents=True)
            repo = self.repos[(kind, repo_id)] = Repo(kind, repo_id, folder)
            self.apply(repo, "initial commit", {".gitattributes": GITATTRIBUTES.encode()}, [])
            if files:
                self.apply(repo, f"add {len(files)} files", files, [])
            return repo

    def apply(self, repo: Repo, summary: str, added: dict[str, bytes], deleted: list[str]) -> Commit:
        """One commit: the deletions, then the additions, and its id, derived from its parent and its contents."""
        for path in deleted:
            self.delete(repo, path)
        for path, data in added.items():
            self.write(repo, path, data)
        parent = repo.commits[-1].oid if repo.commits else ""
        oid = hashlib.sha1(f"{parent}\n{summary}\n{sorted(added)}\n{deleted}".encode()).hexdigest()
        repo.commits.append(Commit(oid, summary, list(added), deleted))
        return repo.commits[-1]

    def delete(self, repo: Repo, path: str) -> None:
        """A file or a folder, the folders it leaves empty, and what of it was in LFS."""
        target = repo.folder / path
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
        for parent in target.parents:  # git has no empty folders
            if parent == repo.folder or any(parent.iterdir()):
                break
            parent.rmdir()
        for lfs_path in [p for p in repo.lfs if p == path or p.startswith(path + "/")]:
            del repo.lfs[lfs_path]

    def write(self, repo: Repo, path: str, data: bytes) -> None:
        """A file, in LFS (and the LFS store) when the Hub's rule puts it there."""
        target = repo.folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if repo.is_lfs(path, len(data), data[:512]):
            repo.lfs[path] = hashlib.sha256(data).hexdigest()
            (self.lfs_store / repo.lfs[path]).write_bytes(data)
        else:
            repo.lfs.pop(path, None)


class Access:
    """Who sends a request and what they may touch: `accounts` maps a token to (username, organisations); every
    repository is public to read, and a token writes to its user's and organisations' repositories."""

    def __init__(self, accounts: dict[str, tuple[str, list[str]]], storage: RepoStorage) -> None:
        self.accounts = accounts
        self.storage = storage

    def account(self, request: Request) -> tuple[str, list[str]] | None:
        """Who sends the request; None for an anonymous one. A token the Hub does not know is refused outright."""
        authorization = request.headers.get("Authorization")
        if not authorization:
            return None
        token = authorization.removeprefix("Bearer ")
        if token not in self.accounts:
            raise HubRefusal(401, INVALID_TOKEN)
        return self.accounts[token]

    def readable(self, request: Request, kind: str, repo_id: str, revision: str | None = None) -> Repo:
        """Every repository here is public; a missing one is 404 (401 to anonymous callers), as on the Hub."""
        account = self.account(request)
        repo = self.storage.get(kind, repo_id)
        if repo is None:
            raise HubRefusal(404 if account else 401, "Repository not found", "RepoNotFound")
        if revision is not None and revision not in ("main", repo.head):
            raise HubRefusal(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo

    def writable(self, request: Request, kind: str, repo_id: str, revision: str = "main") -> Repo:
        repo = self.readable(request, kind, repo_id, revision)
        account = self.account(request)
        if account is None:
            raise HubRefusal(401, "You must be authenticated to write to this repository")
        if repo_id.split("/")[0] not in (account[0], *account[1]):
            raise HubRefusal(403, f"You don't have the rights to write to {kind}s/{repo_id}")
        if revision != "main":
            raise HubRefusal(400, "Commits are only accepted on branch main")
        return repo

    def whoami(self, request: Request) -> Answer:
        """GET /api/whoami-v2: the token's user and organisations."""
        account = self.account(request)
        if account is None:
            raise HubRefusal(401, INVALID_TOKEN)
        name, orgs = account
        return json_answer({"type": "user", "name": name, "orgs": [{"type": "org", "name": o} for o in orgs]})


class Faults:
    """The failures a test asks for: 429s on a route, and commits dropped once a number of files went in."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.limits: dict[str, tuple[int, int]] = {}  # route -> (429s left to answer, Retry-After seconds)
        self.commit_budget: int | None = None  # files still accepted before commits are dropped

    def rate_limit(self, route: str, times: int, retry_after: int = 1) -> None:
        """Answer the next `times` requests of `route` (a handler's name, e.g. "commit") with 429."""
        self.limits[route] = (times, retry_after)

    def drop_commits_after(self, files: int | None) -> None:
        """Accept commits until `files` more files are committed, then close the connection on each commit."""
        self.commit_budget = files

    def check_rate_limit(self, route: str) -> None:
        """Refuse this request of `route` with 429 and the Hub's rate-limit headers while its limit lasts."""
        with self.lock:
            left, retry_after = self.limits.get(route, (0, 0))
            if left == 0:
                return
            self.limits[route] = (left - 1, retry_after)
        headers = {
            "Retry-After": str(retry_after),
            "RateLimit": f'"api";r=0;t={retry_after}',
            "RateLimit-Policy": '"fixed window";"api";q=500;w=300',
        }
        raise HubRefusal(429, "Too Many Requests", headers=headers)

    def spend_commit(self, files: int) -> None:
        """A commit of `files` files goes in, or its connection drops when the budget is spent."""
        if self.commit_budget is not None:
            if self.commit_budget <= 0:
                raise DropConnection
            self.commit_budget -= files


class RepoReads:
    """The endpoints that read a repository: its info, its tree listing (paginated), and its files (resolve)."""

    def __init__(self, storage: RepoStorage, access: Access, endpoint: str, storage_url: str, page_size: int) -> None:
        self.storage, self.access, self.lock = storage, access, storage.lock
        self.endpoint, self.storage_url, self.page_size = endpoint, storage_url, page_size

    def repo_info(self, request: Request, kinds: str, repo_id: str, revision: str | None) -> Answer:
        if request.query:  # blobs=, expand=, ... change what the Hub answers
            not_implemented(request)
        repo = self.access.readable(request, REPO_TYPES[kinds], repo_id, revision)
        with self.lock:
            siblings = [{"rfilename": path} for path in repo.files()]
            info = {"_id": repo.head[:24], "id": repo_id, "author": repo_id.split("/")[0], "sha": repo.head,
                    "private": False, "gated": False, "disabled": False, "tags": [], "siblings": siblings,
                    "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z"}  # fmt: skip
        return json_answer(info)

    def tree(self, request: Request, kinds: str, repo_id: str, revision: str, path: str | None) -> Answer:
        if flag(request.query, "expand"):
            not_implemented(request)  # expand=True adds lastCommit and security info
        repo = self.access.readable(request, REPO_TYPES[kinds], repo_id, revision)
        recursive = flag(request.query, "recursive")
        path = (path or "").strip("/")
        with self.lock:
            if path and not (repo.folder / path).exists():
                raise HubRefusal(404, f"{path} does not exist on {revision}", "EntryNotFound")
            entries = self.listing(repo, path, recursive)
        return self.page(request, entries, recursive)

    @staticmethod
    def listing(repo: Repo, path: str, recursive: bool) -> list[dict]:
        """The entries under `path` (the folders first): its children, or everything below it when recursive."""
        files = [f for f in repo.files() if not path or f.startswith(path + "/")]
        depth = len(PurePosixPath(path).parts) if path else 0
        paths = set()
        for file in files:
            parts = PurePosixPath(file).parts
            for end in range(depth + 1, len(parts) + 1 if recursive else depth + 2):
                paths.add("/".join(parts[:end]))
        return [repo.entry(p) for p in sorted(paths, key=lambda p: (not (repo.folder / p).is_dir(), p))]

    def page(self, request: Request, entries: list[dict], recursive: bool) -> Answer:
        """The page of `entries` the request's cursor points at, with a Link to the next page if there is one."""
        start = int(base64.urlsafe_b64decode(request.query["cursor"][0]).decode()) if "cursor" in request.query else 0
        end = start + self.page_size
        headers = {}
        if end < len(entries):
            cursor = base64.urlsafe_b64encode(str(end).encode()).decode()
            query = f"recursive={str(recursive).lower()}&expand=false&cursor={cursor}"
            headers["Link"] = f'<{self.endpoint}{request.path}?{query}>; rel="next"'
        return json_answer(entries[start:end], headers=headers)

    def resolve(self, request: Request, prefix: str | None, repo_id: str, revision: str, path: str) -> Answer:
        repo = self.access.readable(request, "dataset" if prefix else "model", repo_id, revision)
        with self.lock:
            target = repo.folder / path
            commit = {"X-Repo-Commit": repo.head}
            if not target.is_file():
                raise HubRefusal(404, "Entry not found", "EntryNotFound", headers=commit)
            entry = repo.entry(path)
            if "lfs" in entry:  # the Hub answers with a redirect to its storage, and the facts of the file
                headers = {**commit, "Location": f"{self.storage_url}/{entry['lfs']['oid']}",
                           "X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(entry["size"]),
                           "ETag": f'"{entry["oid"]}"'}  # fmt: skip
                return 302, headers, b""
            data = target.read_bytes()
        return ranged(request, data, {**commit, "ETag": f'"{entry["oid"]}"'})


class RepoWrites:
    """The endpoints that change repositories: create one, preupload (regular or LFS), and commit."""

    def __init__(self, storage: RepoStorage, access: Access, faults: Faults, endpoint: str) -> None:
        self.storage, self.access, self.faults, self.lock = storage, access, faults, storage.lock
        self.endpoint = endpoint

    def create_repo(self, request: Request) -> Answer:
        payload = request.json()
        kind, namespace = payload.get("type") or "model", payload.get("organization")
        repo_id = f"{namespace}/{payload['name']}"
        account = self.access.account(request)
        if account is None:
            raise HubRefusal(401, "You must be authenticated to create a repository")
        if namespace not in (account[0], *account[1]):
            raise HubRefusal(403, f'You don\'t have the rights to create a {kind} under the namespace "{namespace}"')
        url = f"{self.endpoint}/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
        with self.lock:
            if self.storage.get(kind, repo_id) is not None:
                raise HubRefusal(409, f"You already created this {kind} repo", url=url)
            self.storage.create(kind, repo_id)
        return json_answer({"url": url, "name": repo_id, "id": repo_id})

    def preupload(self, request: Request, kinds: str, repo_id: str, revision: str) -> Answer:
        repo = self.access.writable(request, REPO_TYPES[kinds], repo_id, revision)
        answers = []
        with self.lock:
            for file in request.json()["files"]:
                lfs = repo.is_lfs(file["path"], file["size"], base64.b64decode(file["sample"]))
                answer = {"path": file["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
                if (repo.folder / file["path"]).is_file():  # what huggingface_hub compares to skip unchanged files
                    entry = repo.entry(file["path"])
                    answer["oid"] = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
                answers.append(answer)
            return json_answer({"files": answers, "commitOid": repo.head})

    def commit(self, request: Request, kinds: str, repo_id: str, revision: str) -> Answer:
        repo = self.access.writable(request, REPO_TYPES[kinds], repo_id, revision)
        lines = [json.loads(line) for line in request.body.decode().splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            raise HubRefusal(400, "a commit starts with its header")
        with self.lock:
            added, deleted = self.operations(repo, lines[1:])
            self.faults.spend_commit(len(added))
            commit = self.storage.apply(repo, lines[0]["value"]["summary"], added, deleted)
        url = f"{self.endpoint}/{repo.url_prefix}{repo_id}/commit/{commit.oid}"
        return json_answer({"success": True, "commitOid": commit.oid, "commitUrl": url, "hookOutput": "",
                            "pullRequestUrl": None})  # fmt: skip

    def operations(self, repo: Repo, lines: list[dict]) -> tuple[dict[str, bytes], list[str]]:
        """The files a commit's NDJSON lines add (by path) and the paths they delete, refused as the Hub refuses
        a regular file that belongs in LFS, an LFS pointer to nothing uploaded, or a deletion of nothing."""
        added: dict[str, bytes] = {}
        deleted: list[str] = []
        for line in lines:
            key, value = line["key"], line["value"]
            path = value["path"].strip("/")
            if key == "file":
                data = base64.b64decode(value["content"])
                if repo.is_lfs(path, len(data), data[:512]):
                    raise HubRefusal(400, f"Your push was rejected because {path} must be stored in LFS")
                added[path] = data
            elif key == "lfsFile":
                stored = self.storage.lfs_store / value["oid"]
                if not stored.is_file():
                    raise HubRefusal(422, f"Your push was rejected because an LFS pointer of {path} points to a "
                                     "file that does not exist")  # fmt: skip
                added[path] = stored.read_bytes()
            elif key in ("deletedFile", "deletedFolder"):
                target = repo.folder / path
                if not (target.is_dir() if key == "deletedFolder" else target.is_file()):
                    raise HubRefusal(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                deleted.append(path)
            else:
                raise HubRefusal(400, f"unknown commit operation {key!r}")
        return added, deleted


class LfsTransfer:
    """LFS on the Hub: the batch and verify endpoints of the API, and the storage server's signed uploads and
    ranged downloads of the objects."""

    def __init__(self, storage: RepoStorage, access: Access, endpoint: str, storage_url: str) -> None:
        self.storage, self.access, self.lock = storage, access, storage.lock
        self.endpoint, self.storage_url = endpoint, storage_url
        self.upload_keys: dict[str, str] = {}  # sha256 -> the signature its upload URL carries

    def lfs_batch(self, request: Request, prefix: str | None, repo_id: str) -> Answer:
        payload = request.json()
        if payload.get("operation") != "upload" or "basic" not in payload.get("transfers", ["basic"]):
            not_implemented(request)
        ref = payload.get("ref", {}).get("name", "main")
        repo = self.access.writable(request, "dataset" if prefix else "model", repo_id, ref)
        objects = []
        for obj in payload["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if not (self.storage.lfs_store / obj["oid"]).is_file():  # already stored: nothing to send
                with self.lock:
                    key = self.upload_keys.setdefault(obj["oid"], secrets.token_hex(8))
                verify = f"{self.endpoint}/{repo.url_prefix}{repo_id}.git/info/lfs/objects/verify"
                answer["actions"] = {
                    "upload": {"href": f"{self.storage_url}/{obj['oid']}?X-Signature={key}"},
                    "verify": {"href": verify, "header": {"Authorization": request.headers.get("Authorization", "")}},
                }
            objects.append(answer)
        return json_answer({"transfer": "basic", "objects": objects}, headers={"Content-Type": LFS_JSON})

    def lfs_verify(self, request: Request, prefix: str | None, repo_id: str) -> Answer:
        self.access.writable(request, "dataset" if prefix else "model", repo_id)
        obj = request.json()
        stored = self.storage.lfs_store / obj["oid"]
        if not stored.is_file() or stored.stat().st_size != obj["size"]:
            raise HubRefusal(404, f"LFS object {obj['oid']} was not uploaded")
        return json_answer({"success": True}, headers={"Content-Type": LFS_JSON})

    def lfs_upload(self, request: Request, oid: str) -> Answer:
        """The signed URL of the batch answer; like a storage bucket it wants no token, only the signature."""
        if request.query.get("X-Signature") != [self.upload_keys.get(oid)]:
            raise HubRefusal(403, "SignatureDoesNotMatch")
        if hashlib.sha256(request.body).hexdigest() != oid:
            raise HubRefusal(400, "the uploaded content does not match its sha256")
        (self.storage.lfs_store / oid).write_bytes(request.body)
        return 200, {"ETag": f'"{hashlib.md5(request.body).hexdigest()}"'}, b""

    def lfs_download(self, request: Request, oid: str) -> Answer:
        stored = self.storage.lfs_store / oid
        if not stored.is_file():
            raise HubRefusal(404, "NoSuchKey")
        return ranged(request, stored.read_bytes(), {"ETag": f'"{oid}"'})


class HubRouter:
    """Which endpoint answers a request: the Hub's routes by method and path, each behind its rate limit (named
    as `Faults.rate_limit` names it); anything else is not implemented."""

    def __init__(self, faults: Faults, access: Access, reads: RepoReads, writes: RepoWrites, lfs: LfsTransfer) -> None:
        self.faults, self.lfs = faults, lfs
        repo_path = r"/api/(models|datasets)/([^/]+/[^/]+)"
        git_path = r"/(datasets/)?([^/]+/[^/]+)"
        self.routes: list[tuple[str, str, str, Callable[..., Answer]]] = [
            ("whoami", "GET", r"/api/whoami-v2", access.whoami),
            ("agent_harnesses", "GET", r"/api/agent-harnesses", agent_harnesses),
            ("create_repo", "POST", r"/api/repos/create", writes.create_repo),
            ("validate_yaml", "POST", r"/api/validate-yaml", validate_yaml),
            ("repo_info", "GET", rf"{repo_path}(?:/revision/([^/]+))?", reads.repo_info),
            ("tree", "GET", rf"{repo_path}/tree/([^/]+)(?:/(.+))?", reads.tree),
            ("preupload", "POST", rf"{repo_path}/preupload/([^/]+)", writes.preupload),
            ("commit", "POST", rf"{repo_path}/commit/([^/]+)", writes.commit),
            ("lfs_batch", "POST", rf"{git_path}\.git/info/lfs/objects/batch", lfs.lfs_batch),
            ("lfs_verify", "POST", rf"{git_path}\.git/info/lfs/objects/verify", lfs.lfs_verify),
            ("resolve", "GET|HEAD", rf"{git_path}/resolve/([^/]+)/(.+)", reads.resolve),
        ]

    def route_api(self, request: Request) -> Answer:
        for name, methods, pattern, answer in self.routes:
            found = re.fullmatch(pattern, request.path)
            if found and request.method in methods.split("|"):
                self.faults.check_rate_limit(name)
                return answer(request, *found.groups())
        not_implemented(request)

    def route_storage(self, request: Request) -> Answer:
        found = re.fullmatch(r"/([0-9a-f]{64})", request.path)
        if found and request.method == "PUT":
            return self.lfs.lfs_upload(request, found.group(1))
        if found and request.method in ("GET", "HEAD"):
            return self.lfs.lfs_download(request, found.group(1))
        not_implemented(request)


class HubRequestHandler(BaseHTTPRequestHandler):
    """One HTTP/1.1 exchange with an `Origin`: read the request (chunked or not), have the origin answer it, and
    send the answer, or close the connection without one when the answer is to drop it."""

    protocol_version = "HTTP/1.1"
    server: Origin

    def do_GET(self) -> None:
        self.handle_request()

    def do_HEAD(self) -> None:
        self.handle_request()

    def do_POST(self) -> None:
        self.handle_request()

    def do_PUT(self) -> None:
        self.handle_request()

    def handle_request(self) -> None:
        url = urlsplit(self.path)
        request = Request(self.command, unquote(url.path), url.query, self.headers, self.read_body())
        try:
            status, headers, body = self.server.answer(request)
        except DropConnection:
            self.server.hub.record(request, 0, 0)
            self.close_connection = True
            return
        sent = b"" if self.command == "HEAD" else body
        self.server.hub.record(request, status, len(sent))
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(sent)

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def log_message(self, format: str, *args) -> None:
        pass


class Origin(ThreadingHTTPServer):
    """One origin of the stand-in on a free local port (`url`): it answers each request with its `route`, a refusal
    as the Hub words it, and tells its `hub` server what it served and which requests it does not implement."""

    def __init__(self, hub: HubServer) -> None:
        super().__init__(("127.0.0.1", 0), HubRequestHandler)
        self.hub = hub
        self.route: Route | None = None  # set by HubServer.serve
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, request: Request) -> Answer:
        try:
            return self.route(request)
        except Unimplemented as refusal:
            self.hub.note_unknown(request)
            return refusal.answer()
        except HubRefusal as refusal:
            return refusal.answer()


class HubServer:
    """The stand-in's two origins, the API and the LFS storage (another origin, as the Hub's storage is), while they
    serve; the log of every request they served and the list of those nobody here implements."""

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self.log: list[Served] = []
        self.unknown: list[str] = []  # requests it does not implement
        self.api = Origin(self)
        self.storage = Origin(self)

    def serve(self, api: Route, storage: Route) -> None:
        self.api.route, self.storage.route = api, storage
        for origin in (self.api, self.storage):
            threading.Thread(target=origin.serve_forever, daemon=True).start()

    def close(self) -> None:
        for origin in (self.api, self.storage):
            origin.shutdown()
            origin.server_close()

    def record(self, request: Request, status: int, sent: int) -> None:
        served = Served(request.method, request.path, request.query_string, status, sent, len(request.body),
                        request.headers.get("Range"))  # fmt: skip
        with self.lock:
            self.log.append(served)

    def note_unknown(self, request: Request) -> None:
        with self.lock:
            self.unknown.append(f"{request.method} {request.path}")

    def served(self, method: str, prefix: str) -> list[Served]:
        with self.lock:
            return [s for s in self.log if s.method == method and s.path.startswith(prefix)]


class HubStandIn:
    """`accounts`: token -> (username, organisations); a token may write to its user's and organisations'
    repositories. Use as a context manager; `endpoint` is its URL, `environ()` what a client process needs.
    It composes the repositories' storage, the access rules, the faults a test asks for, the endpoints and the
    servers; what a test uses is here."""

    def __init__(
        self,
        accounts: dict[str, tuple[str, list[str]]] = ACCOUNTS,
        root: Path | None = None,
        page_size: int = HUB_PAGE_SIZE,
    ) -> None:
        self.own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="hub-")) if root is None else Path(root)
        self.lock = threading.RLock()
        self.storage = RepoStorage(self.root, self.lock)
        self.faults = Faults(self.lock)
        self.server = HubServer(self.lock)
        self.endpoint, self.storage_url = self.server.api.url, self.server.storage.url
        access = Access(accounts, self.storage)
        reads = RepoReads(self.storage, access, self.endpoint, self.storage_url, page_size)
        writes = RepoWrites(self.storage, access, self.faults, self.endpoint)
        lfs = LfsTransfer(self.storage, access, self.endpoint, self.storage_url)
        self.router = HubRouter(self.faults, access, reads, writes, lfs)

    @property
    def log(self) -> list[Served]:
        """Every request served so far (method, path, status, body bytes sent and received), in order."""
        return self.server.log

    def environ(self, token: str | None, home: Path) -> dict[str, str]:
        """The environment of a client process: this endpoint, no Xet, online, a token ("" for none), and its own
        HF_HOME (the download cache, datasets' cache, no stored login)."""
        return {"HF_ENDPOINT": self.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0",
                "HF_DATASETS_OFFLINE": "0", "HF_TOKEN": token or "", "HF_HOME": str(home)}  # fmt: skip

    def repo(self, kind: str, repo_id: str) -> Repo:
        return self.storage.repos[(kind, repo_id)]

    def create(self, kind: str, repo_id: str, files: dict[str, bytes] | None = None) -> Repo:
        """A repository as the Hub creates it, then one commit of `files` (stored in LFS by the Hub's rule)."""
        return self.storage.create(kind, repo_id, files)

    def rate_limit(self, route: str, times: int, retry_after: int = 1) -> None:
        """Answer the next `times` requests of `route` (a handler's name, e.g. "commit") with 429."""
        self.faults.rate_limit(route, times, retry_after)

    def drop_commits_after(self, files: int | None) -> None:
        """Accept commits until `files` more files are committed, then close the connection on each commit."""
        self.faults.drop_commits_after(files)

    def served(self, method: str, prefix: str) -> list[Served]:
        return self.server.served(method, prefix)

    def __enter__(self) -> HubStandIn:
        self.server.serve(self.router.route_api, self.router.route_storage)
        return self

    def __exit__(self, *exc) -> None:
        self.server.close()
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        assert not self.server.unknown, f"requests the stand-in does not implement: {self.server.unknown}"


def folder_files(folder: Path) -> dict[str, bytes]:
    """The files of a local dataset or checkpoint folder by path, without its dot-paths (scratch space, which
    `ttt publish` leaves at home): what a repository holding that folder holds, beside .gitattributes."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    }


def run_client(code: str, env: dict[str, str], *args: object) -> subprocess.CompletedProcess:
    """A Python snippet run as a client of the stand-in, in a fresh interpreter with `env` (see `environ`);
    `args` are its sys.argv[1:]. For what the user reaches through a library call rather than a command."""
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=Path(__file__).resolve().parents[1],
        timeout=300,
    )


@dataclass
class Request:
    method: str
    path: str  # unquoted, without the query
    query_string: str
    headers: Message  # case-insensitive, as HTTP headers are
    body: bytes

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(self.query_string)

    def json(self) -> dict:
        return json.loads(self.body)


def not_implemented(request: Request) -> NoReturn:
    """Refuse a request the stand-in does not know (501); the server notes it, and the test fails at the end."""
    raise Unimplemented(501, f"the stand-in does not implement {request.method} {request.path}")


def agent_harnesses(request: Request) -> Answer:
    """GET /api/agent-harnesses: the registry huggingface_hub names its client from; empty here."""
    return json_answer({"standardEnvVars": [], "harnesses": {}})


def validate_yaml(request: Request) -> Answer:
    """POST /api/validate-yaml: the YAML header of a card, checked before a commit."""
    content = request.json()["content"]
    header = re.match(r"^---\n(.*?)\n---\n", content, re.DOTALL)
    try:
        yaml.safe_load(header.group(1) if header else "")
    except yaml.YAMLError as err:
        return json_answer({"errors": [{"message": f"invalid YAML: {err}"}], "warnings": []}, 400)
    return json_answer({"errors": [], "warnings": []})


def json_answer(body: object, status: int = 200, headers: dict | None = None) -> Answer:
    return status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(body).encode()


def flag(query: dict[str, list[str]], name: str) -> bool:
    """A boolean query parameter (huggingface_hub sends true/false, its older versions True/False)."""
    return query.get(name, ["false"])[0].lower() == "true"


def ranged(request: Request, data: bytes, headers: dict) -> Answer:
    """The whole file, or the one byte range asked for (206 with Content-Range; 416 outside the file)."""
    headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
    asked = request.headers.get("Range")
    if not asked:
        return 200, headers, data
    found = re.fullmatch(r"bytes=(\d*)-(\d*)", asked)
    if found is None:
        raise HubRefusal(400, f"unsupported Range {asked}")
    start, end = found.groups()
    if start == "":  # the last N bytes
        start, end = max(len(data) - int(end), 0), len(data) - 1
    start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
    if start >= len(data):
        raise HubRefusal(416, "Requested Range Not Satisfiable", headers={"Content-Range": f"bytes */{len(data)}"})
    return 206, {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}, data[start : end + 1]
