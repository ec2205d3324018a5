"""Stage 7: publish a finished dataset folder to the Hugging Face Hub.

A published dataset is a local folder that is also a valid Hub dataset repository:

    README.md                                 the data card
    ttt_manifest.json                         what `ttt train` reads first
    data/train-00000-of-000NN.parquet         the shards

Everything under a dot-path (`.ttt-work/`, `.cache/`, ...) is scratch space and never leaves the machine.

The upload is planned before anything is sent, so that it can be shown (`--dry-run`), split into
commits of bounded size, and resumed: a file whose sha256 already matches the Hub's copy is skipped, so
re-running the same command after a failure only sends what is missing. The card and manifest go in the
last commit, so the Hub never shows a card that describes shards which are not there yet.

huggingface_hub is imported lazily, inside the functions that talk to the Hub, so that this module (and
`check_hub_ready`) can be imported without the pipeline extras.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError
from pipeline.core.files import sha256_file
from pipeline.core.hub import (
    FORMS,
    explain_hub_error,
    hub_error_is_lasting,
    hub_token,
    is_hub_url,
    parse_hub_url,
    retry_rate_limited,
)

CARD_FILES = ("README.md", "ttt_manifest.json")  # uploaded last, in this order, in the final commit
# Remote files that are not in LFS only expose a git blob id; remote_sha256 marks those values with this.
GIT_BLOB_PREFIX = "git-blob-sha1:"

_HASH_CHUNK = 1024 * 1024


class PublishError(UserError):
    """A problem the user can fix (bad target, missing token, network failure); the CLI shows one line.

    A UserError (itself a ValueError) so that cli._fail_cleanly prints it without a traceback.
    """


@dataclass(frozen=True)
class UploadFile:
    path_in_repo: str  # posix path relative to the dataset folder, e.g. "data/train-00000-of-00004.parquet"
    local_path: Path
    size: int
    sha256: str


@dataclass
class UploadPlan:
    repo_id: str
    to_upload: list[UploadFile]  # files whose remote copy is missing or differs
    up_to_date: list[str]  # paths already on the Hub with the same content
    batches: list[list[UploadFile]]  # to_upload split into commits, card and manifest in the last one
    # Remote data/ files with no local counterpart (e.g. shards of an earlier run with another shard
    # count): publish() deletes them in its closing commit, because `datasets` would read them as extra rows.
    stale_remote: list[str] = field(default_factory=list)

    @property
    def upload_bytes(self) -> int:
        return sum(f.size for f in self.to_upload)

    @property
    def commits(self) -> int:
        """Commits the upload takes: one per batch, or one to delete stale shards when nothing else changed."""
        return max(len(self.batches), 1 if self.stale_remote else 0)


# -----------------------------------------------------------------------------
# targets and tokens


def _missing_token_error(repo_id: str) -> PublishError:
    return PublishError(
        f"set HF_TOKEN to a Hugging Face token with write access to publish to {repo_id} "
        "(https://huggingface.co/settings/tokens), or use --dry-run"
    )


def check_hub_ready(target: str, dry_run: bool) -> str | None:
    """Fail fast, before hours of preprocessing, if the run could not be published at the end.

    Returns the repo id for an hf:// target, None for a local target. Only checks the target's form and
    that a token is set; it makes no network call.
    """
    if not is_hub_url(target):
        return None
    repo_id = parse_hub_url(target, "dataset").repo_id
    if not dry_run and hub_token() is None:
        raise _missing_token_error(repo_id)
    return repo_id


# -----------------------------------------------------------------------------
# local side


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file, which is all the Hub reports for files that are not stored in LFS."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def local_files(folder: Path) -> list[UploadFile]:
    """Every regular file under folder that belongs on the Hub, sorted by path, with its sha256.

    Any path with a component starting with "." is skipped, and dot-directories are not even walked, so
    a large `.ttt-work/` scratch area costs nothing.
    """
    folder = Path(folder)
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            local_path = Path(root) / name
            if name.startswith(".") or not local_path.is_file():
                continue
            files.append(
                UploadFile(
                    path_in_repo=local_path.relative_to(folder).as_posix(),
                    local_path=local_path,
                    size=local_path.stat().st_size,
                    sha256=sha256_file(local_path),
                )
            )
    files.sort(key=lambda f: f.path_in_repo)
    return files


# -----------------------------------------------------------------------------
# planning


def _is_up_to_date(f: UploadFile, remote: str | None) -> bool:
    if remote is None:
        return False
    if remote.startswith(GIT_BLOB_PREFIX):
        return remote == GIT_BLOB_PREFIX + git_blob_sha1(f.local_path)
    return remote == f.sha256


def _split_batches(files: list[UploadFile], max_files: int, max_bytes: int) -> list[list[UploadFile]]:
    """Greedy, order-preserving split; a file bigger than max_bytes gets a batch of its own."""
    batches: list[list[UploadFile]] = []
    batch: list[UploadFile] = []
    batch_bytes = 0
    for f in files:
        if batch and (len(batch) >= max_files or batch_bytes + f.size > max_bytes):
            batches.append(batch)
            batch, batch_bytes = [], 0
        batch.append(f)
        batch_bytes += f.size
    if batch:
        batches.append(batch)
    return batches


def plan_upload(
    folder: Path,
    repo_id: str,
    remote_sha256: dict[str, str],
    max_files_per_commit: int = 100,
    max_bytes_per_commit: int = 4 * 1024**3,
) -> UploadPlan:
    """Decide what to send and in which commits, without touching the network.

    Data files go first; README.md and ttt_manifest.json always travel together in the last commit, so a
    reader of the Hub never sees a card or manifest that names shards not uploaded yet. That closing commit
    may exceed max_files_per_commit / max_bytes_per_commit (it is two small files) rather than split them.
    """
    if max_files_per_commit < 1 or max_bytes_per_commit < 1:
        raise ValueError("max_files_per_commit and max_bytes_per_commit must be positive")
    files = local_files(folder)
    to_upload, up_to_date = [], []
    for f in files:
        if _is_up_to_date(f, remote_sha256.get(f.path_in_repo)):
            up_to_date.append(f.path_in_repo)
        else:
            to_upload.append(f)

    body = [f for f in to_upload if f.path_in_repo not in CARD_FILES]
    tail = sorted(
        (f for f in to_upload if f.path_in_repo in CARD_FILES), key=lambda f: CARD_FILES.index(f.path_in_repo)
    )
    batches = _split_batches(body, max_files_per_commit, max_bytes_per_commit)
    if tail:
        last = batches[-1] if batches else []
        fits = (
            len(last) + len(tail) <= max_files_per_commit and sum(f.size for f in last + tail) <= max_bytes_per_commit
        )
        if last and fits:
            last.extend(tail)
        else:
            batches.append(tail)

    local_paths = {f.path_in_repo for f in files}
    stale = sorted(p for p in remote_sha256 if p.startswith("data/") and p not in local_paths)
    return UploadPlan(
        repo_id=repo_id,
        to_upload=[f for batch in batches for f in batch],
        up_to_date=up_to_date,
        batches=batches,
        stale_remote=stale,
    )


# -----------------------------------------------------------------------------
# remote side


def remote_sha256(api: Any, repo_id: str) -> dict[str, str]:
    """Map each file on the Hub now to its content hash; {} when the repo does not exist yet.

    LFS files (all parquet shards, and anything over 10 MB) report their sha256 directly. Small regular
    files (README.md, ttt_manifest.json) only report a git blob id; those values are returned as
    "git-blob-sha1:<id>" and plan_upload compares them with the git blob sha1 of the local file, so an
    unchanged card is not re-committed either. expand=False is enough: the LFS sha256 is part of the plain
    listing, and expand=True would page 50 entries at a time instead of 1000.
    """
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.hf_api import RepoFile

    try:
        entries = list(api.list_repo_tree(repo_id, repo_type="dataset", recursive=True))
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return {}
    hashes = {}
    for entry in entries:
        if not isinstance(entry, RepoFile):
            continue  # a RepoFolder
        if entry.lfs is not None:
            hashes[entry.path] = entry.lfs.sha256
        else:
            hashes[entry.path] = GIT_BLOB_PREFIX + entry.blob_id
    return hashes


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1024**2:
        return f"{n / 1024:.1f} KB"
    if n < 1024**3:
        return f"{n / 1024**2:.1f} MB"
    return f"{n / 1024**3:.2f} GB"


def _check_dataset_folder(folder: Path) -> None:
    """Refuse to publish a folder that is not a finished dataset (a wrong path would upload anything)."""
    if not folder.is_dir():
        raise PublishError(f"{folder} is not a directory")
    missing = [name for name in CARD_FILES if not (folder / name).is_file()]
    if missing:
        raise PublishError(f"{folder} is not a finished dataset: missing {', '.join(missing)}")
    if not any((folder / "data").glob("*.parquet")):
        raise PublishError(f"{folder} is not a finished dataset: no data/*.parquet shards")


RESUME_HINT = "re-run the same command to resume; files already on the Hub are skipped"


def _failure(what: str, err: Exception) -> PublishError:
    """One line; re-running is suggested only where it can help (not for a refused token or access)."""
    hint = "" if hub_error_is_lasting(err) else f"; {RESUME_HINT}"
    return PublishError(f"{what}: {explain_hub_error(err)}{hint}")


def publish(
    folder: Path,
    target: str,
    dry_run: bool = False,
    token: str | None = None,
    api: Any = None,
    echo: Callable[[str], Any] = print,
    max_files_per_commit: int = 100,
    max_bytes_per_commit: int = 4 * 1024**3,
) -> UploadPlan:
    """Upload folder to the Hub dataset repo named by target, skipping what is already there.

    The token is checked before any network call so that a missing token fails in a second, not after the
    repo listing. Rate limits are waited out (retry_rate_limited); any other failure while talking to the Hub
    becomes a one-line PublishError that says what the Hub refused, and for a failure that can pass (network,
    server, rate limit) that re-running resumes, which is true because each commit is atomic and finished files
    are skipped next time.
    """
    folder = Path(folder)
    if not is_hub_url(target):
        raise PublishError(f"publish target must be {FORMS['dataset']}, got {target!r}")
    repo_id = parse_hub_url(target, "dataset").repo_id
    _check_dataset_folder(folder)
    token = hub_token(token)
    if token is None and not dry_run:
        raise _missing_token_error(repo_id)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    remote = _remote_files(api, repo_id, target, dry_run, echo)
    plan = plan_upload(folder, repo_id, remote, max_files_per_commit, max_bytes_per_commit)
    verb = "would delete" if dry_run else "deleting"
    for path in plan.stale_remote:
        echo(f"{verb} {path} from {target}: not part of {folder} (an earlier shard layout)")
    summary = (
        f"{len(plan.to_upload)} files ({_human_bytes(plan.upload_bytes)}) to {target} in {plan.commits} commits; "
        f"{len(plan.up_to_date)} already up to date"
    )
    if dry_run:
        for i, batch in enumerate(plan.batches, 1):
            for f in batch:
                echo(f"would send {f.path_in_repo} ({_human_bytes(f.size)}) in commit {i}/{plan.commits}")
        echo(f"dry run: would send {summary}")
        return plan
    _commit(api, plan, target, echo)
    echo(f"published {summary}")
    return plan


def _remote_files(api: Any, repo_id: str, target: str, dry_run: bool, echo: Callable[[str], Any]) -> dict[str, str]:
    """The Hub's files and hashes; a real run first creates the repo, a dry run plans offline if it must."""
    if dry_run:
        try:
            return remote_sha256(api, repo_id)
        except Exception as e:  # no network, no access: still show the full plan
            echo(f"could not list {target} ({explain_hub_error(e)}); planning as if the repo were empty")
            return {}

    def prepare() -> dict[str, str]:
        api.create_repo(repo_id, repo_type="dataset", exist_ok=True)
        return remote_sha256(api, repo_id)

    try:
        return retry_rate_limited(prepare, echo)
    except Exception as e:
        raise _failure(f"could not prepare {target}", e) from e


def _commit(api: Any, plan: UploadPlan, target: str, echo: Callable[[str], Any]) -> None:
    """One commit per batch; stale shards leave in the closing commit, with the card that no longer names them."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    n = plan.commits
    for i, batch in enumerate((plan.batches or [[]])[:n], 1):
        echo(f"commit {i}/{n}: {len(batch)} files ({_human_bytes(sum(f.size for f in batch))})")
        operations = [CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.local_path)) for f in batch]
        if i == n:
            operations += [CommitOperationDelete(path_in_repo=path) for path in plan.stale_remote]
        commit = functools.partial(
            api.create_commit,
            repo_id=plan.repo_id,
            repo_type="dataset",
            operations=operations,
            commit_message=f"ttt publish: batch {i}/{n} ({len(batch)} files)",
        )
        try:
            retry_rate_limited(commit, echo)
        except Exception as e:
            raise _failure(f"upload to {target} failed in commit {i}/{n}", e) from e
