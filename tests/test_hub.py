"""hf:// locations: one parser for the dataset targets, the stream sources and the generator's checkpoints."""

import pytest

from pipeline.core.hub import HubLocation, HubLocationError, is_hub_url, parse_hub_url


def test_dataset_and_model_locations():
    assert parse_hub_url("hf://datasets/org/name", "dataset") == HubLocation("dataset", "org/name")
    assert parse_hub_url("hf://datasets/my-org/ttt.cc3m_v2/", "dataset").repo_id == "my-org/ttt.cc3m_v2"
    assert parse_hub_url("hf://my-org/ttt-run", "model") == HubLocation("model", "my-org/ttt-run")
    files = parse_hub_url("hf://datasets/org/name/data/train-0000*.parquet", "dataset", allow_path=True)
    assert files == HubLocation("dataset", "org/name", "data/train-0000*.parquet")
    assert files.fs_path == "datasets/org/name/data/train-0000*.parquet"  # as HfFileSystem names it
    assert parse_hub_url("hf://org/name", "model").fs_path == "org/name"


@pytest.mark.parametrize("text", ["out/dataset", "/abs/path", "s3://bucket/x", "datasets/org/name"])
def test_other_locations_are_not_hub_urls(text):
    assert not is_hub_url(text)


@pytest.mark.parametrize(
    "url",
    [
        "hf://models/org/name",
        "hf://datasets/onlyone",
        "hf://datasets/org/name/extra",
        "hf://datasets/org/name@main",
        "hf://datasets//name",
        "hf://org/name",
        "hf://datasets/org/-bad",
    ],
)
def test_a_malformed_dataset_location_names_the_form(url):
    with pytest.raises(HubLocationError, match="expected hf://datasets/ORG/NAME"):
        parse_hub_url(url, "dataset")


@pytest.mark.parametrize("url", ["hf://datasets/org/name", "hf://org/name/step-000001", "hf://onlyone", "hf://a/b c"])
def test_a_malformed_model_location_names_the_form(url):
    with pytest.raises(HubLocationError, match=r"expected hf://ORG/NAME$"):
        parse_hub_url(url, "model")
