"""Stage 1: read image-caption metadata (LAION-400M parquet as published, or CSV/TSV).

Everything is validated before any work starts: patterns that match nothing, unreadable
files, missing columns and empty input are each one clear error.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pipeline.core.errors import UserError
from pipeline.preprocess.options import ColumnMap

CANONICAL_COLUMNS = ["key", "url", "caption", "width", "height", "nsfw", "similarity", "license"]
FORMATS = ("parquet", "csv", "tsv")


class InputError(UserError):
    """A user mistake in the input: reported as one line, never a traceback."""


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Expand globs into a sorted, de-duplicated list of files; a pattern that matches nothing is an error."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise InputError(f"--input {pattern!r} matches no file; check the path or quote the glob")
        files.extend(Path(m).resolve() for m in matches)
    return list(dict.fromkeys(files))


def detect_format(path: Path, forced: str | None) -> str:
    if forced:
        return forced
    suffixes = [s.lower() for s in path.suffixes]
    for fmt in FORMATS:
        if f".{fmt}" in suffixes:
            return fmt
    raise InputError(f"cannot tell the format of {path.name}; pass --input-format parquet|csv|tsv")


def _file_columns(path: Path, fmt: str) -> list[str]:
    if fmt == "parquet":
        return pq.read_schema(path).names
    delimiter = "\t" if fmt == "tsv" else ","
    with pacsv.open_csv(path, parse_options=pacsv.ParseOptions(delimiter=delimiter)) as reader:
        return reader.schema.names


def _read_file(path: Path, fmt: str, columns: list[str]) -> pa.Table:
    if fmt == "parquet":
        return pq.read_table(path, columns=columns)
    delimiter = "\t" if fmt == "tsv" else ","
    return pacsv.read_csv(
        path,
        parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            include_columns=columns,
            column_types={c: pa.string() for c in columns},
        ),
    )


def required_columns(columns: ColumnMap, needs_size: bool, needs_nsfw: bool) -> dict[str, str]:
    """Canonical name -> input column for the columns the run cannot do without."""
    needed = {"url": "every run", "caption": "every run"}
    needed |= {"width": "the filters", "height": "the filters"} if needs_size else {}
    needed |= {"nsfw": "the filters"} if needs_nsfw else {}
    required = {}
    for canonical, who in needed.items():
        name = getattr(columns, canonical)
        if name is None:
            raise InputError(f"{who} needs a {canonical} column but none is mapped (--{canonical}-col)")
        required[canonical] = name
    return required


def read_metadata(
    files: list[Path],
    columns: ColumnMap,
    needs_size: bool,
    needs_nsfw: bool,
    input_format: str | None = None,
) -> pd.DataFrame:
    """Read every file into one DataFrame with the canonical columns, in file then row order."""
    required = required_columns(columns, needs_size, needs_nsfw)
    optional = {c: getattr(columns, c) for c in CANONICAL_COLUMNS if c not in required and getattr(columns, c)}
    plans = []
    for path in files:
        fmt = detect_format(path, input_format)
        try:
            available = set(_file_columns(path, fmt))
        except (OSError, pa.ArrowInvalid) as err:
            raise InputError(f"cannot read {path}: {err}") from None
        missing = [name for name in required.values() if name not in available]
        if missing:
            raise InputError(
                f"{path.name} has no column {', '.join(map(repr, missing))} "
                f"(it has {', '.join(sorted(available))}); map it with --url-col/--caption-col/... "
                "or relax the filter that needs it"
            )
        present = {c: n for c, n in optional.items() if n in available}
        plans.append((path, fmt, {**required, **present}))

    frames = []
    for path, fmt, mapping in plans:
        try:
            table = _read_file(path, fmt, list(dict.fromkeys(mapping.values())))
        except (OSError, pa.ArrowInvalid) as err:
            raise InputError(f"cannot read {path}: {err}") from None
        frame = pd.DataFrame({canonical: table.column(name).to_pandas() for canonical, name in mapping.items()})
        frames.append(frame.reindex(columns=CANONICAL_COLUMNS))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=CANONICAL_COLUMNS)
    if rows.empty:
        raise InputError(f"the input ({len(files)} file(s)) holds no rows")
    return normalize(rows)


def normalize(rows: pd.DataFrame) -> pd.DataFrame:
    """Give every canonical column one dtype, and every row a stable key."""
    rows = rows.copy()
    for column in ("url", "caption", "nsfw", "license"):
        rows[column] = rows[column].astype("string")
    for column in ("width", "height"):
        rows[column] = pd.to_numeric(rows[column], errors="coerce")
    rows["similarity"] = pd.to_numeric(rows["similarity"], errors="coerce")
    # LAION's SAMPLE_ID when there is one; otherwise a hash of the URL (unique once URLs are deduplicated).
    missing_key = rows["key"].isna()
    rows["key"] = rows["key"].astype("string")
    rows.loc[missing_key, "key"] = [url_key(u) for u in rows.loc[missing_key, "url"].fillna("")]
    rows["key"] = rows["key"].str.replace(r"\.0$", "", regex=True)
    return rows


def url_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]
