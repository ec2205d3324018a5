"""Read a finished img2dataset output folder, so `ttt preprocess --from-images` can skip downloading.

img2dataset writes one of three layouts (see its writer.py); all three are read here:

- webdataset: `00000.tar` holding `<key>.jpg`, `<key>.txt`, `<key>.json` for each successful sample, next to
  a `00000.parquet` of metadata for every sample (no image column) and `00000_stats.json`;
- parquet: `00000.parquet` with one row per sample, its image bytes in a `jpg`/`png`/`webp` column
  (null when the download failed), next to `00000_stats.json`;
- files: a folder `00000/` holding `<key>.jpg`, `<key>.txt`, `<key>.json` per successful sample, next to
  the same metadata parquet and stats json as webdataset.

`read_records` reads only metadata and gives each row a `source` string that says where its image bytes
are; `load_images` fetches the bytes later, a batch at a time, so a large output never sits in memory.
"""

from __future__ import annotations

import bisect
import json
import os
import tarfile
from collections.abc import Collection
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.errors import UserError
from pipeline.preprocess.metadata import CANONICAL_COLUMNS, normalize

# The image extensions img2dataset can write (its `encode_format`), plus "jpeg" for hand-made outputs.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")

# Canonical column -> names img2dataset may have saved it under. The url and caption are renamed to
# `url` and `caption` by img2dataset itself; the rest exist only if the user passed
# `--save_additional_columns`, under their LAION names (or already canonical ones).
_KEY_COLUMN = "SAMPLE_ID"
_WIDTH_COLUMN = "original_width"
_HEIGHT_COLUMN = "original_height"
_OPTIONAL_COLUMNS = {
    "nsfw": ("NSFW", "nsfw"),
    "similarity": ("similarity", "SIMILARITY"),
    "license": ("LICENSE", "license"),
}
# Every metadata column read_records can use; anything else img2dataset saved is ignored.
_USEFUL_COLUMNS = [
    "key",
    "status",
    "url",
    "caption",
    _KEY_COLUMN,
    _WIDTH_COLUMN,
    _HEIGHT_COLUMN,
    *(name for names in _OPTIONAL_COLUMNS.values() for name in names),
]


class Img2DatasetOutputError(UserError):
    """The folder is not a usable img2dataset output: reported as one line, never a traceback."""


def detect_output_format(folder: Path) -> str:
    """Say which img2dataset layout `folder` holds: "webdataset", "parquet" or "files".

    Exactly one layout must be present: mixing two outputs in one folder would silently double or
    drop samples, so it is an error rather than a guess.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise Img2DatasetOutputError(f"--from-images {folder}: no such folder")
    found = []
    if _tar_files(folder):
        found.append("webdataset")
    if _image_parquet_files(folder):
        found.append("parquet")
    if _shard_folders(folder):
        found.append("files")
    if not found:
        raise Img2DatasetOutputError(
            f"--from-images {folder}: no img2dataset output found (no *.tar, no *.parquet with an image "
            "column, no 00000/ shard folders); point it at img2dataset's --output_folder"
        )
    if len(found) > 1:
        raise Img2DatasetOutputError(
            f"--from-images {folder}: holds more than one img2dataset output ({' and '.join(found)}); "
            "keep one output format per folder"
        )
    return found[0]


def read_records(folder: Path) -> pd.DataFrame:
    """One row per successfully downloaded sample, sorted by shard then img2dataset key.

    Columns: the canonical metadata columns plus `source`, which locates the image bytes for
    `load_images`. Width and height are the original image size, as the size filters expect.
    """
    folder = Path(folder).resolve()
    output_format = detect_output_format(folder)
    if output_format == "webdataset":
        raw = pd.DataFrame([meta for path in _tar_files(folder) for meta in _tar_records(path)])
    elif output_format == "parquet":
        frames = [_parquet_records(path) for path in _image_parquet_files(folder)]
        raw = pd.concat(frames, ignore_index=True)
    else:
        raw = pd.DataFrame([meta for shard in _shard_folders(folder) for meta in _folder_records(shard)])
    if raw.empty:
        raise Img2DatasetOutputError(
            f"--from-images {folder}: no successfully downloaded image in this {output_format} output; "
            "img2dataset's *_stats.json files say why"
        )
    raw = raw.sort_values(["_shard", "key"], kind="stable").reset_index(drop=True)
    return _canonical(raw)


def load_images(sources: list[str]) -> list[bytes]:
    """The image bytes for each `source` from `read_records`, in the same order.

    Sources are grouped by file so each tar or parquet is opened once per call, however many of its
    images are asked for.
    """
    wanted: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for position, source in enumerate(sources):
        kind, path, locator = _parse_source(source)
        wanted.setdefault((kind, path), []).append((position, locator))

    images: list[bytes | None] = [None] * len(sources)
    for (kind, path), requests in wanted.items():
        try:
            if kind == "tar":
                found = _load_from_tar(path, [locator for _, locator in requests])
            elif kind == "parquet":
                found = _load_from_parquet(path, [int(locator) for _, locator in requests])
            else:
                found = [Path(path).read_bytes() for _ in requests]
        except (OSError, KeyError, IndexError, tarfile.TarError, pa.ArrowException) as err:
            raise Img2DatasetOutputError(f"cannot read image from {kind}:{path}: {err}") from None
        for (position, _), data in zip(requests, found, strict=True):
            images[position] = data
    return images  # type: ignore[return-value]  # every position was filled above


# --- finding the shards ------------------------------------------------------------------------------


def _tar_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.glob("*.tar") if path.is_file())


def _image_parquet_files(folder: Path) -> list[Path]:
    """Parquet files with an image column; webdataset/files outputs also write per-shard parquet metadata
    without one, which must not be mistaken for the parquet layout."""
    files = []
    for path in sorted(folder.glob("*.parquet")):
        if path.is_file() and _image_column(_parquet_schema(path)) is not None:
            files.append(path)
    return files


def _shard_folders(folder: Path) -> list[Path]:
    """img2dataset's files layout names each shard folder with digits only (00000, 00001, ...)."""
    return sorted(path for path in folder.iterdir() if path.is_dir() and path.name.isdigit())


def _parquet_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (OSError, pa.ArrowException) as err:
        raise Img2DatasetOutputError(f"cannot read {path}: {err}") from None


def _image_column(schema: pa.Schema) -> str | None:
    for name in IMAGE_EXTENSIONS:
        if name in schema.names and pa.types.is_binary(schema.field(name).type):
            return name
    return None


def _image_extension(extensions: Collection[str]) -> str | None:
    """The first image extension among a sample's files (a sample has exactly one in practice)."""
    for ext in IMAGE_EXTENSIONS:
        if ext in extensions:
            return ext
    return None


# --- reading metadata, one layout at a time ----------------------------------------------------------


def _tar_records(path: Path) -> list[dict]:
    """The json metadata of each successful sample in one webdataset tar."""
    records = []
    try:
        with tarfile.open(path) as tar:
            members: dict[str, dict[str, tarfile.TarInfo]] = {}
            for member in tar:
                if member.isfile():
                    stem, _, ext = member.name.rpartition(".")
                    members.setdefault(stem, {})[ext] = member
            for stem, by_ext in members.items():
                image_ext = _image_extension(by_ext)
                if "json" not in by_ext or image_ext is None:
                    continue
                meta = json.load(tar.extractfile(by_ext["json"]))  # type: ignore[arg-type]
                if meta.get("status") != "success":
                    continue
                meta.setdefault("key", os.path.basename(stem))
                meta["_shard"] = str(path)
                meta["source"] = f"tar:{path}#{by_ext[image_ext].name}"
                records.append(meta)
    except (OSError, tarfile.TarError, json.JSONDecodeError) as err:
        raise Img2DatasetOutputError(f"cannot read {path}: {err}") from None
    return records


def _parquet_records(path: Path) -> pd.DataFrame:
    """The successful rows of one parquet-layout shard, reading every column but the image bytes."""
    schema = _parquet_schema(path)
    if "status" not in schema.names or "key" not in schema.names:
        raise Img2DatasetOutputError(f"{path} has no `status`/`key` column; it is not img2dataset output")
    columns = [name for name in _USEFUL_COLUMNS if name in schema.names]
    try:
        frame = pq.read_table(path, columns=columns).to_pandas()
    except (OSError, pa.ArrowException) as err:
        raise Img2DatasetOutputError(f"cannot read {path}: {err}") from None
    frame["source"] = [f"parquet:{path}#{row}" for row in range(len(frame))]
    frame["_shard"] = str(path)
    return frame[frame["status"] == "success"]


def _folder_records(shard: Path) -> list[dict]:
    """The json metadata of each successful sample in one files-layout shard folder."""
    names = set(os.listdir(shard))
    records = []
    for name in sorted(names):
        stem, _, ext = name.rpartition(".")
        if ext != "json":
            continue
        image_ext = _image_extension([e for e in IMAGE_EXTENSIONS if f"{stem}.{e}" in names])
        if image_ext is None:
            continue
        try:
            meta = json.loads((shard / name).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise Img2DatasetOutputError(f"cannot read {shard / name}: {err}") from None
        if meta.get("status") != "success":
            continue
        meta.setdefault("key", stem)
        meta["_shard"] = str(shard)
        meta["source"] = f"file:{shard / f'{stem}.{image_ext}'}"
        records.append(meta)
    return records


def _first_column(raw: pd.DataFrame, names: tuple[str, ...]) -> pd.Series | None:
    for name in names:
        if name in raw.columns:
            return raw[name]
    return None


def _canonical(raw: pd.DataFrame) -> pd.DataFrame:
    """Map img2dataset's column names onto the canonical ones; absent columns become missing values."""
    rows = pd.DataFrame(index=raw.index, columns=CANONICAL_COLUMNS, dtype=object)
    # LAION's SAMPLE_ID when it was saved (and is set for that row), else img2dataset's own key.
    key = raw["key"].astype("string")
    if _KEY_COLUMN in raw.columns:
        sample_id = raw[_KEY_COLUMN].astype("string")  # normalize() drops a float's trailing ".0"
        key = sample_id.where(sample_id.notna(), key)
    rows["key"] = key
    for canonical, name in (
        ("url", "url"),
        ("caption", "caption"),
        ("width", _WIDTH_COLUMN),
        ("height", _HEIGHT_COLUMN),
    ):
        if name in raw.columns:
            rows[canonical] = raw[name]
    for canonical, names in _OPTIONAL_COLUMNS.items():
        column = _first_column(raw, names)
        if column is not None:
            rows[canonical] = column
    rows["source"] = raw["source"].astype("string")
    rows = normalize(rows)
    return rows[[*CANONICAL_COLUMNS, "source"]].reset_index(drop=True)


# --- loading image bytes -----------------------------------------------------------------------------


def _parse_source(source: str) -> tuple[str, str, str]:
    """Split "tar:/p/00000.tar#000001.jpg" into ("tar", "/p/00000.tar", "000001.jpg").

    The locator is split off at the last "#", so a "#" inside the folder path is harmless.
    """
    kind, sep, rest = source.partition(":")
    if not sep or kind not in ("tar", "parquet", "file"):
        raise Img2DatasetOutputError(f"not an image source from read_records: {source!r}")
    if kind == "file":
        return kind, rest, ""
    path, sep, locator = rest.rpartition("#")
    if not sep or not locator or (kind == "parquet" and not locator.isdigit()):
        raise Img2DatasetOutputError(f"not an image source from read_records: {source!r}")
    return kind, path, locator


def _load_from_tar(path: str, member_names: list[str]) -> list[bytes]:
    with tarfile.open(path) as tar:
        members = {member.name: member for member in tar if member.isfile()}
        images = []
        for name in member_names:
            handle = tar.extractfile(members[name])
            assert handle is not None  # members holds regular files only
            images.append(handle.read())
    return images


def _load_from_parquet(path: str, rows: list[int]) -> list[bytes]:
    """Read only the row groups that hold the wanted rows, and only the image column."""
    with open(path, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        column = _image_column(parquet.schema_arrow)
        if column is None:
            raise KeyError(f"{path} has no image column")
        group_starts = []
        total = 0
        for group in range(parquet.num_row_groups):
            group_starts.append(total)
            total += parquet.metadata.row_group(group).num_rows
        for row in rows:
            if not 0 <= row < total:
                raise IndexError(f"row {row} is out of range (the file has {total} rows)")
        groups = sorted({bisect.bisect_right(group_starts, row) - 1 for row in rows})
        table = parquet.read_row_groups(groups, columns=[column])
        # Where each wanted group starts inside `table`, which holds only the wanted groups.
        table_starts = {}
        offset = 0
        for group in groups:
            table_starts[group] = offset
            offset += parquet.metadata.row_group(group).num_rows
    values = table.column(column)
    images = []
    for row in rows:
        group = bisect.bisect_right(group_starts, row) - 1
        data = values[table_starts[group] + row - group_starts[group]].as_py()
        if data is None:
            raise KeyError(f"row {row} has no image (its download failed)")
        images.append(data)
    return images
