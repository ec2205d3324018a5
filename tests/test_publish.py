"""Tests for pipeline/preprocess/publish.py, up to the network call: the Hub is a fake api object.

tests/test_hub_publish.py runs the same paths through huggingface_hub against a local stand-in for the Hub's API."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile, RepoFolder

from pipeline.core.hub import HubLocationError
from pipeline.preprocess.publish import (
    GIT_BLOB_PREFIX,
    PublishError,
    check_hub_ready,
    git_blob_sha1,
    local_files,
    plan_upload,
    publish,
    remote_sha256,
)

TARGET = "hf://datasets/org/name"


def write(folder: Path, rel: str, data: bytes) -> Path:
    path = folder / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def make_dataset(folder: Path, n_shards: int = 3, shard_bytes: int = 10) -> Path:
    """A finished dataset folder, plus scratch dot-paths that must never be uploaded."""
    for i in range(n_shards):
        write(folder, f"data/train-{i:05d}-of-{n_shards:05d}.parquet", bytes([i]) * shard_bytes)
    write(folder, "README.md", b"# card\n")
    write(folder, "ttt_manifest.json", b'{"shards": 3}\n')
    write(folder, ".ttt-work/state.json", b"{}")
    write(folder, ".cache/x/y.bin", b"cache")
    write(folder, "data/.partial.parquet", b"half")
    return folder


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def lfs_entry(path: str, data: bytes) -> RepoFile:
    """What list_repo_tree yields for an LFS file (built the way huggingface_hub builds it from JSON)."""
    lfs = {"size": len(data), "oid": sha256(data), "pointerSize": 134}
    return RepoFile(path=path, size=len(data), oid="0" * 40, lfs=lfs)


def git_entry(path: str, data: bytes) -> RepoFile:
    """What list_repo_tree yields for a small regular (non-LFS) file: only its git blob id."""
    blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return RepoFile(path=path, size=len(data), oid=blob_id)


class FakeApi:
    """Records every call; list_repo_tree returns `tree`, or raises `list_error`."""

    def __init__(self, tree=(), list_error: Exception | None = None, commit_error: Exception | None = None):
        self.tree = list(tree)
        self.list_error = list_error
        self.commit_error = commit_error
        self.calls: list[tuple[str, tuple, dict]] = []
        self.commits: list[dict] = []

    def create_repo(self, *args, **kwargs):
        self.calls.append(("create_repo", args, kwargs))

    def list_repo_tree(self, *args, **kwargs):
        self.calls.append(("list_repo_tree", args, kwargs))
        if self.list_error is not None:
            raise self.list_error
        return iter(self.tree)

    def create_commit(self, *args, **kwargs):
        self.calls.append(("create_commit", args, kwargs))
        if self.commit_error is not None:
            raise self.commit_error
        self.commits.append(kwargs)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def committed_paths(api: FakeApi) -> list[list[str]]:
    return [[op.path_in_repo for op in c["operations"]] for c in api.commits]


def repo_not_found() -> RepositoryNotFoundError:
    response = SimpleNamespace(headers={}, request=None)  # the two things the error's __init__ reads
    return RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)


# -----------------------------------------------------------------------------
# check_hub_ready


def test_check_hub_ready(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert check_hub_ready("out/dataset", dry_run=False) is None
    assert check_hub_ready(TARGET, dry_run=True) == "org/name"
    with pytest.raises(PublishError, match="HF_TOKEN"):
        check_hub_ready(TARGET, dry_run=False)
    monkeypatch.setenv("HF_TOKEN", "")
    with pytest.raises(PublishError, match="HF_TOKEN"):
        check_hub_ready(TARGET, dry_run=False)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert check_hub_ready(TARGET, dry_run=False) == "org/name"
    with pytest.raises(HubLocationError, match="hf://datasets/ORG/NAME"):
        check_hub_ready("hf://datasets/onlyone", dry_run=True)


# -----------------------------------------------------------------------------
# local_files / plan_upload


def test_local_files_skips_dot_paths_and_hashes(tmp_path):
    make_dataset(tmp_path)
    files = local_files(tmp_path)
    assert [f.path_in_repo for f in files] == [
        "README.md",
        "data/train-00000-of-00003.parquet",
        "data/train-00001-of-00003.parquet",
        "data/train-00002-of-00003.parquet",
        "ttt_manifest.json",
    ]
    readme = files[0]
    assert readme.local_path == tmp_path / "README.md"
    assert readme.size == len(b"# card\n")
    assert readme.sha256 == sha256(b"# card\n")


def test_git_blob_sha1_matches_git(tmp_path):
    path = write(tmp_path, "README.md", b"hello\n")
    # `git hash-object` is the definition; fall back to the well-known id of "hello\n" without git.
    try:
        expected = subprocess.run(
            ["git", "hash-object", str(path)], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        expected = "ce013625030ba8dba906f756967f9e9ca394464a"
    assert git_blob_sha1(path) == expected == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_plan_card_and_manifest_last(tmp_path):
    make_dataset(tmp_path, n_shards=5)
    plan = plan_upload(tmp_path, "org/name", {}, max_files_per_commit=2)
    paths = [[f.path_in_repo for f in batch] for batch in plan.batches]
    assert paths == [
        ["data/train-00000-of-00005.parquet", "data/train-00001-of-00005.parquet"],
        ["data/train-00002-of-00005.parquet", "data/train-00003-of-00005.parquet"],
        ["data/train-00004-of-00005.parquet"],
        ["README.md", "ttt_manifest.json"],
    ]
    assert [f.path_in_repo for f in plan.to_upload] == [p for batch in paths for p in batch]
    assert plan.up_to_date == []
    assert plan.repo_id == "org/name"


def test_plan_card_joins_last_batch_when_it_fits(tmp_path):
    make_dataset(tmp_path, n_shards=3)
    plan = plan_upload(tmp_path, "org/name", {}, max_files_per_commit=100)
    assert len(plan.batches) == 1
    assert [f.path_in_repo for f in plan.batches[0]][-2:] == ["README.md", "ttt_manifest.json"]


def test_plan_batches_by_bytes_and_oversized_file_alone(tmp_path):
    write(tmp_path, "data/a.parquet", b"a" * 40)
    write(tmp_path, "data/b.parquet", b"b" * 40)
    write(tmp_path, "data/c.parquet", b"c" * 500)  # bigger than the byte limit on its own
    write(tmp_path, "data/d.parquet", b"d" * 40)
    write(tmp_path, "data/e.parquet", b"e" * 40)
    write(tmp_path, "README.md", b"r" * 15)
    write(tmp_path, "ttt_manifest.json", b"m" * 15)
    plan = plan_upload(tmp_path, "org/name", {}, max_bytes_per_commit=100)
    paths = [[f.path_in_repo for f in batch] for batch in plan.batches]
    assert paths == [
        ["data/a.parquet", "data/b.parquet"],
        ["data/c.parquet"],
        ["data/d.parquet", "data/e.parquet"],
        ["README.md", "ttt_manifest.json"],  # 80 + 30 > 100: the card gets its own closing commit
    ]
    for batch in plan.batches:
        assert len(batch) == 1 or sum(f.size for f in batch) <= 100


def test_plan_resume_skips_matching_and_resends_changed(tmp_path):
    make_dataset(tmp_path, n_shards=3)
    remote = {
        "data/train-00000-of-00003.parquet": sha256(bytes([0]) * 10),  # same content: skip
        "data/train-00001-of-00003.parquet": sha256(b"something else"),  # changed: resend
        "README.md": GIT_BLOB_PREFIX + git_entry("README.md", b"# card\n").blob_id,  # same: skip
        "ttt_manifest.json": GIT_BLOB_PREFIX + git_entry("x", b"{}").blob_id,  # changed: resend
    }
    plan = plan_upload(tmp_path, "org/name", remote)
    assert plan.up_to_date == ["README.md", "data/train-00000-of-00003.parquet"]
    assert [f.path_in_repo for f in plan.to_upload] == [
        "data/train-00001-of-00003.parquet",
        "data/train-00002-of-00003.parquet",
        "ttt_manifest.json",
    ]
    assert plan.stale_remote == []


def test_plan_reports_stale_remote_shards(tmp_path):
    make_dataset(tmp_path, n_shards=2)
    remote = {"data/train-00000-of-00005.parquet": "ab" * 32, ".gitattributes": GIT_BLOB_PREFIX + "0" * 40}
    plan = plan_upload(tmp_path, "org/name", remote)
    assert plan.stale_remote == ["data/train-00000-of-00005.parquet"]


def test_plan_nothing_to_do(tmp_path):
    make_dataset(tmp_path, n_shards=1)
    remote = {f.path_in_repo: f.sha256 for f in local_files(tmp_path)}
    plan = plan_upload(tmp_path, "org/name", remote)
    assert plan.to_upload == [] and plan.batches == []
    assert len(plan.up_to_date) == 3


# -----------------------------------------------------------------------------
# remote_sha256


def test_remote_sha256_reads_lfs_and_git_blobs(tmp_path):
    api = FakeApi(
        tree=[
            RepoFolder(path="data", oid="1" * 40),
            lfs_entry("data/train-00000-of-00001.parquet", b"shard"),
            git_entry("README.md", b"# card\n"),
        ]
    )
    hashes = remote_sha256(api, "org/name")
    assert hashes == {
        "data/train-00000-of-00001.parquet": sha256(b"shard"),
        "README.md": GIT_BLOB_PREFIX + hashlib.sha1(b"blob 7\0# card\n").hexdigest(),
    }
    (name, args, kwargs) = api.calls[0]
    assert name == "list_repo_tree" and args == ("org/name",)
    assert kwargs["repo_type"] == "dataset" and kwargs["recursive"] is True


def test_remote_sha256_missing_repo_is_empty():
    assert remote_sha256(FakeApi(list_error=repo_not_found()), "org/name") == {}


def test_remote_sha256_other_errors_propagate():
    with pytest.raises(ConnectionError):
        remote_sha256(FakeApi(list_error=ConnectionError("down")), "org/name")


# -----------------------------------------------------------------------------
# publish


def test_publish_missing_token_fails_before_any_api_call(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    make_dataset(tmp_path)
    api = FakeApi()
    with pytest.raises(PublishError, match="HF_TOKEN"):
        publish(tmp_path, TARGET, api=api, echo=lambda s: None)
    assert api.calls == []


def test_publish_rejects_local_target_and_unfinished_folder(tmp_path):
    api = FakeApi()
    with pytest.raises(PublishError, match="hf://datasets/ORG/NAME"):
        publish(tmp_path, "out/dataset", token="t", api=api, echo=lambda s: None)
    write(tmp_path, "data/train-00000-of-00001.parquet", b"x")
    write(tmp_path, "README.md", b"# card\n")
    with pytest.raises(PublishError, match="ttt_manifest.json"):
        publish(tmp_path, TARGET, token="t", api=api, echo=lambda s: None)
    assert api.calls == []


def test_publish_commits_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    make_dataset(tmp_path, n_shards=3)
    api = FakeApi(list_error=repo_not_found())  # a brand new repo
    lines: list[str] = []
    plan = publish(tmp_path, TARGET, api=api, echo=lines.append, max_files_per_commit=2)

    assert api.names() == ["create_repo", "list_repo_tree", "create_commit", "create_commit", "create_commit"]
    _, args, kwargs = api.calls[0]
    assert args == ("org/name",) and kwargs == {"repo_type": "dataset", "exist_ok": True}
    assert committed_paths(api) == [
        ["data/train-00000-of-00003.parquet", "data/train-00001-of-00003.parquet"],
        ["data/train-00002-of-00003.parquet"],
        ["README.md", "ttt_manifest.json"],
    ]
    for i, commit in enumerate(api.commits, 1):
        assert commit["repo_id"] == "org/name"
        assert commit["repo_type"] == "dataset"
        n_files = len(commit["operations"])
        assert commit["commit_message"] == f"ttt publish: batch {i}/3 ({n_files} files)"
        for op in commit["operations"]:
            assert isinstance(op, CommitOperationAdd)
            assert op.path_or_fileobj == str(tmp_path / op.path_in_repo)
            # huggingface_hub hashes the file itself; it must agree with ours.
            assert op.upload_info.sha256.hex() == sha256((tmp_path / op.path_in_repo).read_bytes())
    assert len(plan.to_upload) == 5
    assert lines[-1] == f"published 5 files (51 B) to {TARGET} in 3 commits; 0 already up to date"


def test_publish_resume_sends_only_missing_and_changed(tmp_path):
    make_dataset(tmp_path, n_shards=3)
    api = FakeApi(
        tree=[
            RepoFile(path=".gitattributes", size=10, oid="2" * 40),
            RepoFolder(path="data", oid="1" * 40),
            lfs_entry("data/train-00000-of-00003.parquet", bytes([0]) * 10),  # done before the failure
            lfs_entry("data/train-00001-of-00003.parquet", b"old content"),  # changed since
        ]
    )
    lines: list[str] = []
    plan = publish(tmp_path, TARGET, token="hf_test", api=api, echo=lines.append)
    assert committed_paths(api) == [
        [
            "data/train-00001-of-00003.parquet",
            "data/train-00002-of-00003.parquet",
            "README.md",
            "ttt_manifest.json",
        ]
    ]
    assert plan.up_to_date == ["data/train-00000-of-00003.parquet"]
    assert "1 already up to date" in lines[-1]

    # Once everything matches, a re-run commits nothing.
    done = FakeApi(tree=[lfs_entry(f.path_in_repo, f.local_path.read_bytes()) for f in local_files(tmp_path)])
    plan = publish(tmp_path, TARGET, token="hf_test", api=done, echo=lambda s: None)
    assert done.commits == [] and plan.batches == []
    assert len(plan.up_to_date) == 5


def test_publish_dry_run_makes_no_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)  # a dry run needs no token
    make_dataset(tmp_path, n_shards=3)
    api = FakeApi(tree=[lfs_entry("data/train-00000-of-00003.parquet", bytes([0]) * 10)])
    lines: list[str] = []
    plan = publish(tmp_path, TARGET, dry_run=True, api=api, echo=lines.append)
    assert api.names() == ["list_repo_tree"]
    assert [f.path_in_repo for f in plan.to_upload] == [
        "data/train-00001-of-00003.parquet",
        "data/train-00002-of-00003.parquet",
        "README.md",
        "ttt_manifest.json",
    ]
    text = "\n".join(lines)
    for f in plan.to_upload:
        assert f.path_in_repo in text
    assert "data/train-00000-of-00003.parquet" not in text
    assert "(10 B)" in text
    assert lines[-1].startswith("dry run: would send 4 files") and "in 1 commits; 1 already up to date" in lines[-1]


def test_publish_dry_run_offline_plans_everything(tmp_path):
    make_dataset(tmp_path, n_shards=2)
    api = FakeApi(list_error=ConnectionError("no network"))
    lines: list[str] = []
    plan = publish(tmp_path, TARGET, dry_run=True, api=api, echo=lines.append)
    assert len(plan.to_upload) == 4 and api.commits == []
    assert any("as if the repo were empty" in line for line in lines)


def test_publish_network_failure_says_resume(tmp_path):
    make_dataset(tmp_path, n_shards=1)
    api = FakeApi(commit_error=ConnectionError("connection reset\nrequest id: 123"))
    with pytest.raises(PublishError, match="re-run the same command to resume") as info:
        publish(tmp_path, TARGET, token="hf_test", api=api, echo=lambda s: None)
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionError)

    api = FakeApi(list_error=ConnectionError("down"))
    with pytest.raises(PublishError, match="resume"):
        publish(tmp_path, TARGET, token="hf_test", api=api, echo=lambda s: None)
    assert "create_commit" not in api.names()


def test_publish_error_is_a_user_error():
    from pipeline.core.errors import UserError

    assert issubclass(PublishError, UserError) and issubclass(PublishError, ValueError)


def test_publish_deletes_stale_shards_in_the_closing_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    make_dataset(tmp_path, n_shards=2)
    old_shard = "data/train-00004-of-00005.parquet"  # from an earlier run with 5 shards
    api = FakeApi(tree=[lfs_entry(old_shard, b"old")])
    publish(tmp_path, TARGET, api=api, echo=lambda line: None)
    *_, closing = api.commits
    deleted = [op.path_in_repo for op in closing["operations"] if isinstance(op, CommitOperationDelete)]
    assert deleted == [old_shard]
    assert "README.md" in [op.path_in_repo for op in closing["operations"]]


def test_publish_deletes_stale_shards_even_when_everything_else_is_up_to_date(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    make_dataset(tmp_path, n_shards=1)
    tree = [lfs_entry(f.path_in_repo, f.local_path.read_bytes()) for f in local_files(tmp_path)]
    api = FakeApi(tree=[*tree, lfs_entry("data/train-00001-of-00002.parquet", b"old")])
    publish(tmp_path, TARGET, api=api, echo=lambda line: None)
    assert len(api.commits) == 1
    assert [type(op) for op in api.commits[0]["operations"]] == [CommitOperationDelete]
