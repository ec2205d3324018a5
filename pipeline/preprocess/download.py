"""Stage 3: download and resize one shard's images with img2dataset, inside a Dask task.

img2dataset's top-level `download()` starts its own process pool, which a daemonic Dask
worker cannot do; its `Downloader` is what its own distributors call once per shard, so
that is what runs here. A bad URL never stops the run: every failure is counted by a
normalised reason (HTTP status, timeout, undecodable image, ...).
"""

from __future__ import annotations

import io
import os
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

# albumentations (imported by img2dataset) otherwise asks PyPI for a newer version on every import.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

# Columns handed to img2dataset; `row` maps its output back to the shard's plan order.
_DOWNLOAD_COLUMNS = ["url", "caption", "row"]


@dataclass(frozen=True)
class DownloadSettings:
    image_size: int
    resize_mode: str = "center_crop"
    timeout: float = 10.0
    retries: int = 0
    thread_count: int = 128  # concurrent requests: at 0.3 s per image, 128 threads fetch ~400 images/s
    encode_quality: int = 95


@dataclass
class ImageBatch:
    """A shard's rows that have an image: plan columns plus JPEG bytes at the target size."""

    rows: pd.DataFrame  # canonical metadata columns, in plan order
    jpegs: list[bytes]
    failures: Counter  # reason -> count, for rows that have no image
    seconds: float


def failure_reason(message: str) -> str:
    """Normalise img2dataset's error strings into a small set of countable reasons."""
    text = message.lower()
    http = re.search(r"http error (\d{3})", text)
    if http:
        return f"HTTP {http.group(1)}"
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(word in text for word in ("decod", "cannot identify image", "truncated", "image file is")):
        return "undecodable image"
    if "connection refused" in text or "name or service not known" in text or "urlopen error" in text:
        return "connection error"
    if "x-robots-tag" in text:
        return "disallowed by X-Robots-Tag"
    return "other: " + message[:60]


def _resizer(settings: DownloadSettings):
    from img2dataset.resizer import Resizer

    return Resizer(
        image_size=settings.image_size,
        resize_mode=settings.resize_mode,
        resize_only_if_bigger=False,
        encode_quality=settings.encode_quality,
        encode_format="jpg",
    )


def download_shard(shard_index: int, rows: pd.DataFrame, settings: DownloadSettings) -> ImageBatch:
    """Fetch and resize every URL of the shard with img2dataset's Downloader; keep plan order."""
    from img2dataset.downloader import Downloader
    from img2dataset.writer import ParquetSampleWriter

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"ttt-download-{shard_index:05d}-") as work:
        work_dir = Path(work)
        request = pa.table(
            {
                "url": pa.array(rows["url"].tolist(), pa.string()),
                "caption": pa.array(rows["caption"].tolist(), pa.string()),
                "row": pa.array(range(len(rows)), pa.int64()),
            }
        )
        request_path = work_dir / "request.feather"
        with pa.OSFile(str(request_path), "wb") as sink, pa.ipc.new_file(sink, request.schema) as writer:
            writer.write_table(request)
        (work_dir / "out").mkdir()
        downloader = Downloader(
            sample_writer_class=ParquetSampleWriter,
            resizer=_resizer(settings),
            # A thread per row at most (a dask worker has hung starting them: development.md).
            thread_count=max(1, min(settings.thread_count, len(rows))),
            save_caption=True,
            extract_exif=False,
            output_folder=str(work_dir / "out"),
            column_list=_DOWNLOAD_COLUMNS,
            timeout=settings.timeout,
            number_sample_per_shard=max(len(rows), 1),
            oom_shard_count=5,
            compute_hash=None,
            verify_hash_type=None,
            encode_format="jpg",
            retries=settings.retries,
            user_agent_token="ttt",
            disallowed_header_directives=["noai", "noimageai", "noindex", "noimageindex"],
        )
        downloader.download_shard((shard_index, str(request_path)))
        result = pq.read_table(work_dir / "out" / f"{shard_index:05d}.parquet").to_pandas()
    result = result.sort_values("row")
    ok = result["status"] == "success"
    failures = Counter(failure_reason(str(m)) for m in result.loc[~ok, "error_message"])
    # Rows the downloader never reported (it should report every one) count as failures too.
    unreported = len(rows) - len(result)
    if unreported:
        failures["not reported by downloader"] += unreported
    succeeded = result.loc[ok]
    return ImageBatch(
        rows=rows.iloc[succeeded["row"].to_numpy()].reset_index(drop=True),
        jpegs=list(succeeded["jpg"]),
        failures=failures,
        seconds=time.perf_counter() - start,
    )


def resize_local_images(rows: pd.DataFrame, images: list[bytes], settings: DownloadSettings) -> ImageBatch:
    """Bring already-downloaded images to the target size with img2dataset's resizer (for --from-images)."""
    start = time.perf_counter()
    resizer = _resizer(settings)
    kept, jpegs, failures = [], [], Counter()
    for position, data in enumerate(images):
        jpeg, *_, error = resizer(io.BytesIO(data))
        if error is not None:
            failures[failure_reason(error)] += 1
            continue
        kept.append(position)
        jpegs.append(jpeg)
    return ImageBatch(rows.iloc[kept].reset_index(drop=True), jpegs, failures, time.perf_counter() - start)
