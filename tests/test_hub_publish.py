"""`ttt publish` and `ttt preprocess --dataset hf://...` through the real huggingface_hub client, against the
local stand-in for the Hub's HTTP API (tests/hub_stand_in.py): repository creation, listing with LFS hashes,
pre-upload, the LFS batch API, commits; resuming; refusals and rate limits."""

from __future__ import annotations

from tests.support.commands import run_ttt
from tests.support.hub_stand_in import HubStandIn, folder_files, run_client

TARGET = "hf://datasets/ttt-org/sample"
CARD = ["README.md", "ttt_manifest.json"]


def hub_files(hub: HubStandIn, repo_id: str) -> dict[str, bytes]:
    repo = hub.repo("dataset", repo_id)
    return {path: (repo.folder / path).read_bytes() for path in repo.files() if path != ".gitattributes"}


def test_publish_creates_the_repo_uploads_the_shards_to_lfs_and_a_rerun_sends_nothing(sample_dataset, tmp_path):
    with HubStandIn(root=tmp_path / "hub") as hub:
        env = hub.environ("hf_ada", tmp_path / "hf-home")
        result = run_ttt("publish", "--dataset", sample_dataset, TARGET, env=env)

        expected = folder_files(sample_dataset)
        assert hub_files(hub, "ttt-org/sample") == expected
        repo = hub.repo("dataset", "ttt-org/sample")
        shards = {path: data for path, data in expected.items() if path.startswith("data/")}
        assert len(shards) == 8 and sorted(repo.lfs) == sorted(shards)  # parquet goes to LFS, the card does not
        # One commit after the Hub's own, with the card last; the shards' bytes went to the LFS storage by PUT.
        assert [c.summary for c in repo.commits] == ["initial commit", "ttt publish: batch 1/1 (10 files)"]
        assert repo.commits[-1].added[-2:] == CARD
        puts = hub.served("PUT", "/")
        assert sorted(s.received for s in puts) == sorted(len(data) for data in shards.values())
        kilobytes = sum(len(data) for data in expected.values()) / 1024
        assert f"published 10 files ({kilobytes:.1f} KB) to {TARGET} in 1 commits" in result.stdout

        seen = len(hub.log)
        again = run_ttt("publish", "--dataset", sample_dataset, TARGET, env=env)
        assert "published 0 files (0 B)" in again.stdout and "10 already up to date" in again.stdout
        assert len(repo.commits) == 2
        # The listing's LFS sha256 and git blob ids were enough: nothing was pre-uploaded, sent or committed.
        assert {(s.method, s.path) for s in hub.log[seen:] if s.path != "/api/agent-harnesses"} == {
            ("POST", "/api/repos/create"),  # 409: it exists
            ("GET", "/api/datasets/ttt-org/sample/tree/main"),
        }


PUBLISH_IN_BATCHES = """
import sys
from pipeline.preprocess.publish import publish
publish(sys.argv[1], sys.argv[2], max_files_per_commit=3)
"""


def test_an_upload_cut_off_mid_way_resumes_without_sending_twice(sample_dataset, tmp_path):
    """Commits of 3 files (the default, 100, makes one commit of the sample): the connection drops at the second."""
    with HubStandIn(root=tmp_path / "hub") as hub:
        env = hub.environ("hf_ada", tmp_path / "hf-home")
        hub.drop_commits_after(3)
        cut = run_client(PUBLISH_IN_BATCHES, env, sample_dataset, TARGET)
        assert cut.returncode == 1
        assert cut.stderr.strip().splitlines()[-1] == (
            f"pipeline.preprocess.publish.PublishError: upload to {TARGET} failed in commit 2/4: RemoteProtocolError: "
            "Server disconnected without sending a response.; re-run the same command to resume; files already on "
            "the Hub are skipped"
        )
        repo = hub.repo("dataset", "ttt-org/sample")
        assert repo.files() == [".gitattributes", *(f"data/train-0000{i}-of-00008.parquet" for i in range(3))]

        hub.drop_commits_after(None)
        seen = len(hub.log)
        resumed = run_client(PUBLISH_IN_BATCHES, env, sample_dataset, TARGET)
        assert resumed.returncode == 0, resumed.stderr
        assert "published 7 files (" in resumed.stdout and "3 already up to date" in resumed.stdout
        assert hub_files(hub, "ttt-org/sample") == folder_files(sample_dataset)
        assert [c.added for c in repo.commits[2:]] == [
            [f"data/train-0000{i}-of-00008.parquet" for i in (3, 4, 5)],
            [f"data/train-0000{i}-of-00008.parquet" for i in (6, 7)],
            CARD,  # the card waits for every shard it names
        ]
        # Shards 3-5 reached the LFS storage before the cut: only 6 and 7 were sent again.
        sent = sorted(s.received for s in hub.log[seen:] if s.method == "PUT")
        assert sent == sorted((sample_dataset / f"data/train-0000{i}-of-00008.parquet").stat().st_size for i in (6, 7))


def test_preprocess_to_the_hub_replaces_an_earlier_shard_layout(sample_dataset, tmp_path):
    """The repository holds the sample in 8 shards; a run with 2 shards publishes its own and deletes the 8 in the
    closing commit, with the card that no longer names them."""
    with HubStandIn(root=tmp_path / "hub") as hub:
        hub.create("dataset", "ttt-org/codes", folder_files(sample_dataset))
        staged = tmp_path / "staged"
        target = "hf://datasets/ttt-org/codes"
        env = hub.environ("hf_ada", tmp_path / "hf-home")
        result = run_ttt("preprocess", "--sample-rows", 100, "--shards", 2, "--dataset", target, "--local-dir", staged,
                         env=env)  # fmt: skip

        assert hub_files(hub, "ttt-org/codes") == folder_files(staged)
        closing = hub.repo("dataset", "ttt-org/codes").commits[-1]
        assert closing.added == ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", *CARD]
        assert closing.deleted == [f"data/train-0000{i}-of-00008.parquet" for i in range(8)]
        printed = " ".join(result.stderr.split())  # the summary goes to stderr, wrapped to the terminal
        assert f"deleting data/train-00007-of-00008.parquet from {target}" in printed


def test_refused_tokens_and_rate_limits_are_one_line_or_a_wait(sample_dataset, tmp_path):
    with HubStandIn(root=tmp_path / "hub") as hub:
        hub.create("dataset", "ttt-org/sample")
        cases = {
            "hf_forged": "could not prepare hf://datasets/ttt-org/sample: the Hub refused the token (401 Invalid "
            "credentials in Authorization header); set HF_TOKEN to a valid token from "
            "https://huggingface.co/settings/tokens",
            "hf_eve": "upload to hf://datasets/ttt-org/sample failed in commit 1/1: the token may not do this (403 "
            "You don't have the rights to write to datasets/ttt-org/sample); publishing and pushing need a token "
            "with write access",
        }
        for token, message in cases.items():
            refused = run_ttt("publish", "--dataset", sample_dataset, TARGET,
                              env=hub.environ(token, tmp_path / "hf-home"), check=False)  # fmt: skip
            assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
            assert refused.stderr.strip().splitlines() == [f"Error: {message}"]  # re-running would not help
        assert hub.served("PUT", "/") == [] and len(hub.repo("dataset", "ttt-org/sample").commits) == 1

        env = hub.environ("hf_ada", tmp_path / "hf-home")
        hub.rate_limit("commit", 1, retry_after=3600)  # longer than anyone should wait at a terminal
        limited = run_ttt("publish", "--dataset", sample_dataset, TARGET, env=env, check=False)
        assert limited.stderr.strip().splitlines()[-1] == (
            f"Error: upload to {TARGET} failed in commit 1/1: the Hub is rate limiting this client (429 Too Many "
            "Requests); try again in 3600 s; re-run the same command to resume; files already on the Hub are skipped"
        )
        # Short waits are waited out, where huggingface_hub does not retry (creating the repo, committing).
        hub.rate_limit("create_repo", 1)
        hub.rate_limit("commit", 1)
        waited = run_ttt("publish", "--dataset", sample_dataset, TARGET, env=env)
        assert waited.stdout.count("the Hub is rate limiting this client (429); waiting 1 s (attempt 1 of 5)") == 2
        assert hub_files(hub, "ttt-org/sample") == folder_files(sample_dataset)
