"""Reading real img2dataset outputs: each one is written by img2dataset's own Downloader and writers,
fetching a few small images from a local HTTP server, so the tests follow img2dataset's actual layout."""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.preprocess import img2dataset_output
from pipeline.preprocess.img2dataset_output import Img2DatasetOutputError, load_images, read_records
from pipeline.sample.domain import serve_folder

# img2dataset imports albumentations, which otherwise asks PyPI for a newer version on import (slow offline).
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
from img2dataset.downloader import Downloader  # noqa: E402
from img2dataset.resizer import Resizer  # noqa: E402
from img2dataset.writer import FilesSampleWriter, ParquetSampleWriter, WebDatasetSampleWriter  # noqa: E402

WRITERS = {
    "webdataset": WebDatasetSampleWriter,
    "parquet": ParquetSampleWriter,
    "files": FilesSampleWriter,
}
COLUMN_LIST = ["url", "caption", "SAMPLE_ID", "NSFW"]
OUTPUT_SIZE = 32

# (file name, format, original width, original height); every image is served except "missing.png".
IMAGES = {
    "wide.png": ("PNG", 40, 30),
    "tall.jpg": ("JPEG", 50, 64),
    "square.png": ("PNG", 80, 80),
}

# Two shards, so the sort by shard then key is exercised; shard 0 has one URL that 404s, and the
# sample in shard 1 has no SAMPLE_ID, so its key must fall back to img2dataset's own key.
SHARDS = {
    0: [
        {"file": "wide.png", "caption": "a wide picture", "SAMPLE_ID": 101, "NSFW": "UNLIKELY"},
        {"file": "missing.png", "caption": "never downloaded", "SAMPLE_ID": 102, "NSFW": "UNLIKELY"},
        {"file": "tall.jpg", "caption": "a tall picture", "SAMPLE_ID": 103, "NSFW": "NSFW"},
    ],
    1: [
        {"file": "square.png", "caption": "a square picture", "SAMPLE_ID": None, "NSFW": None},
    ],
}
# What read_records must return, in order: (key, file, caption, nsfw).
EXPECTED = [
    ("101", "wide.png", "a wide picture", "UNLIKELY"),
    ("103", "tall.jpg", "a tall picture", "NSFW"),
    ("000010", "square.png", "a square picture", None),  # img2dataset key: shard 1, sample 0
]


@pytest.fixture(scope="module")
def image_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Serve the test images on 127.0.0.1 (any free port); yields the base URL."""
    folder = tmp_path_factory.mktemp("images")
    for name, (fmt, width, height) in IMAGES.items():
        Image.new("RGB", (width, height), (200, 40, 90)).save(folder / name, format=fmt)
    with serve_folder(folder, port=0) as base_url:
        yield base_url


def run_img2dataset(output_format: str, base_url: str, folder: Path, shards: dict[int, list[dict]]) -> Path:
    """Write `shards` with img2dataset's Downloader into `folder`, as `img2dataset --output_format` would."""
    output = folder / "output"
    output.mkdir()
    downloader = Downloader(
        sample_writer_class=WRITERS[output_format],
        resizer=Resizer(image_size=OUTPUT_SIZE, resize_mode="center_crop", resize_only_if_bigger=False),
        thread_count=4,
        save_caption=True,
        extract_exif=False,
        output_folder=str(output),
        column_list=COLUMN_LIST,
        timeout=5,
        number_sample_per_shard=10,
        oom_shard_count=5,
        compute_hash=None,
        verify_hash_type=None,
        encode_format="jpg",
        retries=0,
        user_agent_token=None,
        disallowed_header_directives=None,
    )
    for shard_id, samples in shards.items():
        table = pa.table(
            {
                "url": [f"{base_url}/{sample['file']}" for sample in samples],
                "caption": [sample["caption"] for sample in samples],
                "SAMPLE_ID": pa.array([sample["SAMPLE_ID"] for sample in samples], pa.int64()),
                "NSFW": pa.array([sample["NSFW"] for sample in samples], pa.string()),
            }
        )
        feather = folder / f"shard_{shard_id}.feather"
        with pa.OSFile(str(feather), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        ok, _ = downloader((shard_id, str(feather)))
        assert ok, f"img2dataset failed on shard {shard_id}"
    return output


@pytest.fixture(scope="module", params=list(WRITERS))
def output(request: pytest.FixtureRequest, image_server: str, tmp_path_factory: pytest.TempPathFactory):
    """(format, folder) for a real img2dataset output of SHARDS in each of the three formats."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, run_img2dataset(request.param, image_server, folder, SHARDS)


@pytest.fixture(scope="module")
def webdataset_output(image_server: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_img2dataset("webdataset", image_server, tmp_path_factory.mktemp("webdataset-only"), SHARDS)


@pytest.fixture(scope="module")
def parquet_output(image_server: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_img2dataset("parquet", image_server, tmp_path_factory.mktemp("parquet-only"), SHARDS)


def test_successful_samples_come_back_in_order_with_their_metadata(output: tuple[str, Path]) -> None:
    output_format, folder = output
    rows = read_records(folder)

    assert list(rows.columns) == [
        "key", "url", "caption", "width", "height", "nsfw", "similarity", "license", "source"
    ]  # fmt: skip
    assert list(rows["key"]) == [key for key, _, _, _ in EXPECTED]
    assert list(rows["caption"]) == [caption for _, _, caption, _ in EXPECTED]
    assert [url.rsplit("/", 1)[1] for url in rows["url"]] == [name for _, name, _, _ in EXPECTED]
    assert [None if pd.isna(v) else v for v in rows["nsfw"]] == [nsfw for _, _, _, nsfw in EXPECTED]
    # The ORIGINAL size, not img2dataset's 32x32 output.
    assert list(rows["width"]) == [IMAGES[name][1] for _, name, _, _ in EXPECTED]
    assert list(rows["height"]) == [IMAGES[name][2] for _, name, _, _ in EXPECTED]
    # Not saved by img2dataset here, so missing rather than invented.
    assert rows["similarity"].isna().all()
    assert rows["license"].isna().all()

    prefix = {"webdataset": "tar:", "parquet": "parquet:", "files": "file:"}[output_format]
    assert all(source.startswith(prefix + str(folder.resolve())) for source in rows["source"])


def test_sources_name_the_image_where_img2dataset_put_it(output: tuple[str, Path]) -> None:
    output_format, folder = output
    sources = list(read_records(folder)["source"])
    root = folder.resolve()
    if output_format == "webdataset":
        assert sources == [f"tar:{root}/00000.tar#000000.jpg", f"tar:{root}/00000.tar#000002.jpg",
                           f"tar:{root}/00001.tar#000010.jpg"]  # fmt: skip
    elif output_format == "files":
        assert sources == [f"file:{root}/00000/000000.jpg", f"file:{root}/00000/000002.jpg",
                           f"file:{root}/00001/000010.jpg"]  # fmt: skip
    else:
        # Row indices follow img2dataset's write order, which is download-completion order.
        for source in sources:
            path, row = source.removeprefix("parquet:").rsplit("#", 1)
            assert path in (f"{root}/00000.parquet", f"{root}/00001.parquet")
            assert 0 <= int(row) < 3


def test_load_images_returns_decodable_images_in_the_order_asked(output: tuple[str, Path]) -> None:
    _, folder = output
    rows = read_records(folder)
    sources = list(rows["source"])
    # Asked out of order and with a repeat: the answer follows the request.
    order = [2, 0, 1, 0]
    images = load_images([sources[i] for i in order])
    assert len(images) == len(order)
    for data in images:
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG"
            assert image.size == (OUTPUT_SIZE, OUTPUT_SIZE)
    assert images[1] == images[3]
    assert load_images([]) == []


def test_load_images_opens_each_tar_once(webdataset_output: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = webdataset_output
    sources = list(read_records(folder)["source"])
    opened: list[str] = []
    real_open = tarfile.open

    def counting_open(name, *args, **kwargs):
        opened.append(str(name))
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(img2dataset_output.tarfile, "open", counting_open)
    load_images(sources + sources)
    assert sorted(opened) == sorted({source[4:].rsplit("#", 1)[0] for source in sources})


def test_parquet_metadata_is_read_without_the_image_column(
    parquet_output: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = parquet_output
    asked: list[list[str]] = []
    real_read_table = pq.read_table

    def recording_read_table(source, *args, columns=None, **kwargs):
        asked.append(columns)
        return real_read_table(source, *args, columns=columns, **kwargs)

    monkeypatch.setattr(img2dataset_output.pq, "read_table", recording_read_table)
    read_records(folder)
    assert asked and all(columns is not None and "jpg" not in columns for columns in asked)


def test_missing_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(Img2DatasetOutputError, match="no such folder"):
        read_records(tmp_path / "nope")


def test_folder_without_img2dataset_output_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    # A parquet without an image column is metadata, not the parquet output format.
    pq.write_table(pa.table({"url": ["http://x"], "status": ["success"]}), tmp_path / "00000.parquet")
    with pytest.raises(Img2DatasetOutputError, match="no img2dataset output found"):
        read_records(tmp_path)


@pytest.mark.parametrize("output_format", list(WRITERS))
def test_output_with_no_successful_sample_is_an_error(output_format: str, image_server: str, tmp_path: Path) -> None:
    shards = {0: [{"file": "missing.png", "caption": "gone", "SAMPLE_ID": 1, "NSFW": "UNLIKELY"}]}
    folder = run_img2dataset(output_format, image_server, tmp_path, shards)
    with pytest.raises(Img2DatasetOutputError, match="no successfully downloaded image"):
        read_records(folder)


def test_two_output_formats_in_one_folder_is_an_error(image_server: str, tmp_path: Path) -> None:
    folder = run_img2dataset("webdataset", image_server, tmp_path, {0: SHARDS[0]})
    (folder / "00003").mkdir()  # as if a files-format output had been written here too
    with pytest.raises(Img2DatasetOutputError, match="more than one img2dataset output"):
        read_records(folder)


def test_unknown_source_is_an_error() -> None:
    with pytest.raises(Img2DatasetOutputError, match="not an image source"):
        load_images(["http://example.com/a.jpg"])
    with pytest.raises(Img2DatasetOutputError, match="not an image source"):
        load_images(["parquet:/data/00000.parquet#first"])


def test_vanished_image_is_an_error(output: tuple[str, Path]) -> None:
    _, folder = output
    source = read_records(folder)["source"].iloc[0]
    kind, _, rest = source.partition(":")
    if kind == "file":
        broken = str(Path(rest).with_name("999999.jpg"))
    else:
        broken = rest.rsplit("#", 1)[0] + "#" + ("999" if kind == "parquet" else "999999.jpg")
    with pytest.raises(Img2DatasetOutputError, match="cannot read image"):
        load_images([f"{kind}:{broken}"])
