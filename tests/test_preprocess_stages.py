"""The preprocessing stages one at a time, without Dask: encode, serialise + write, report, card."""

import io
from collections import Counter

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from huggingface_hub import DatasetCard
from PIL import Image

from pipeline.core.filters import FilterConfig
from pipeline.core.shard_format import DatasetFacts, binary_to_codes, read_facts
from pipeline.preprocess.card import describe_filters, render_card, size_category
from pipeline.preprocess.download import ImageBatch
from pipeline.preprocess.encode import CodeBatch, EncodeSettings, decode_jpegs, encode_shard
from pipeline.preprocess.manifest import ShardRecord
from pipeline.preprocess.metadata import CANONICAL_COLUMNS
from pipeline.preprocess.report import RunSummary
from pipeline.preprocess.writer import WriteSettings, serialize_shard, write_shard
from pipeline.sample.domain import Scene, Shape, render_stored
from pipeline.vqgan.codec import cached_vqgan, encode, images_to_tensor, sample_vqgan_spec

SCENES = [
    Scene(Shape("red", "circle")),
    Scene(Shape("blue", "square"), Shape("yellow", "triangle"), "left of"),
    Scene(Shape("white", "triangle"), Shape("green", "circle"), "above"),
]


def jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def image_batch(sizes: tuple[int, ...] = (64, 64, 64)) -> ImageBatch:
    """Three downloaded sample images with their metadata rows, as the download stage hands them on."""
    rows = pd.DataFrame(
        {
            "key": ["k0", "k1", "k2"],
            "url": [f"http://x/{i}.jpg" for i in range(3)],
            "caption": [scene.caption for scene in SCENES],
            "width": [120, 130, 140],
            "height": [120, 130, 140],
            "nsfw": ["UNLIKELY"] * 3,
            "similarity": [0.31, np.nan, 0.35],
            "license": ["CC0-1.0", None, "CC0-1.0"],
        }
    )[CANONICAL_COLUMNS]
    images = [jpeg(render_stored(scene, 128, size)) for scene, size in zip(SCENES, sizes, strict=True)]
    return ImageBatch(rows=rows, jpegs=images, failures=Counter({"HTTP 404": 2}), seconds=1.5)


@pytest.fixture(scope="module")
def encoded() -> CodeBatch:
    return encode_shard(image_batch(), sample_vqgan_spec(), EncodeSettings(image_size=64, batch_size=2, device="cpu"))


def test_encode_gives_each_image_the_codes_of_the_vqgan(encoded):
    spec = sample_vqgan_spec()
    assert encoded.codes.shape == (3, 8, 8) and encoded.codes.dtype == np.int64
    pixels = decode_jpegs(encoded.images.jpegs, 64)
    one_batch = encode(cached_vqgan(spec, "cpu"), images_to_tensor(pixels)).numpy()
    assert np.array_equal(encoded.codes, one_batch)  # batches of 2 give what one batch of 3 gives
    assert 0 <= encoded.codes.min() and encoded.codes.max() < spec.codebook_size
    assert encoded.images.rows["key"].tolist() == ["k0", "k1", "k2"]


def test_an_image_of_the_wrong_size_never_reaches_the_encoder():
    with pytest.raises(ValueError, match="image of 32x32 reached the encoder; expected 64"):
        decode_jpegs(image_batch(sizes=(64, 32, 64)).jpegs, 64)
    assert decode_jpegs([], 64).shape == (0, 64, 64, 3)


def test_serialise_then_write_puts_the_rows_and_facts_in_place_atomically(encoded, tmp_path):
    spec = sample_vqgan_spec()
    facts = DatasetFacts(spec.codebook_size, 8, 8, 64, spec.identity)
    blob = serialize_shard(encoded, WriteSettings(facts, num_shards=4), index=2, planned_rows=5)
    record = blob.record
    assert record.path == "data/train-00002-of-00004.parquet" and record.rows == 3 and record.planned_rows == 5
    assert record.bytes == len(blob.data) and record.jpeg_bytes == sum(map(len, encoded.images.jpegs))
    assert record.failures == {"HTTP 404": 2} and record.seconds["download"] == 1.5
    serialising = record.seconds["write"]
    written = write_shard(tmp_path, blob)
    path = tmp_path / record.path
    assert path.read_bytes() == blob.data and written.seconds["write"] > serialising  # the write's time is added
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left behind
    table = pq.read_table(path)
    assert table.column("original_width").to_pylist() == [120, 130, 140]  # canonical -> shard column names
    assert table.column("similarity").to_pylist()[1] is None and table.column("license").to_pylist()[1] is None
    codes = [binary_to_codes(blob, 8, 8) for blob in table.column("code").to_pylist()]
    assert np.array_equal(np.stack(codes), encoded.codes)
    assert read_facts(path) == facts


def summary() -> RunSummary:
    def shard(index: int, rows: int, failures: dict) -> ShardRecord:
        seconds = {"download": 2.0, "encode": 4.0, "write": 0.5}
        return ShardRecord(
            f"data/{index}.parquet", rows, 100 * rows, "0" * 64, rows + 2, 1000 * rows, failures, seconds
        )

    shards = [shard(0, 10, {"HTTP 404": 1, "timeout": 1}), shard(1, 20, {"HTTP 404": 2})]
    return RunSummary(100, Counter({"caption too short": 30, "duplicate URL": 6}), shards, 2, 0.01, 10.0, 2, 34)


def test_the_report_counts_every_row_once():
    report = summary()
    assert report.rows_after_filters == 64 and report.rows_written == 30
    assert report.failed == Counter({"HTTP 404": 3, "timeout": 1})
    assert report.bytes_per_sample == 100 and report.jpeg_bytes == 30_000
    # Download handles every planned row (12 + 22 in 4 s), encode and write only the rows with images.
    assert report.stage_rate("download") == pytest.approx(34 / 4.0)
    assert report.stage_rate("encode") == pytest.approx(30 / 8.0)
    text = " ".join(str(cell) for column in report.table().columns for cell in column._cells)
    assert "filtered: caption too short" in text and "failed: HTTP 404" in text and "2 of 2 (2 this run)" in text


def test_the_card_is_a_hub_card_with_the_run_facts():
    spec = sample_vqgan_spec()
    facts = DatasetFacts(spec.codebook_size, 8, 8, 64, spec.identity)
    text = render_card(facts, summary(), FilterConfig(), "2 metadata files", "ttt preprocess --shards 2", "cc0-1.0",
                       "my-codes", "my-org/my-codes", vqgan_note="A note.")  # fmt: skip
    card = DatasetCard(text)
    data = card.data.to_dict()
    assert data["license"] == "cc0-1.0" and data["size_categories"] == ["n<1K"] and data["pretty_name"] == "my-codes"
    assert data["configs"][0]["data_files"][0] == {"split": "train", "path": "data/train-*.parquet"}
    assert {f["name"]: f["dtype"] for f in data["dataset_info"]["features"]}["code"] == "binary"
    assert data["dataset_info"]["splits"][0]["num_examples"] == 30
    for fact in ("| rows | 30 |", "8 x 8 (64 codes per image)", spec.identity.ckpt_sha256, "A note.",
                 'load_dataset("my-org/my-codes"', "ttt preprocess --shards 2", "caption too short"):  # fmt: skip
        assert fact in text, fact


def test_size_categories_and_filter_descriptions():
    assert [size_category(n) for n in (0, 999, 1000, 5_000_000_000)] == ["n<1K", "n<1K", "1K<n<10K", "1B<n<10B"]
    assert describe_filters(FilterConfig()) == (
        "caption >= 3 characters; positive width and height; aspect ratio <= 2; NSFW label in {UNLIKELY}; "
        "first occurrence of each URL"
    )
    relaxed = FilterConfig(min_caption_length=0, max_aspect_ratio=None, allowed_nsfw=None, dedupe_urls=False)
    assert describe_filters(relaxed) == "caption >= 0 characters; positive width and height"
