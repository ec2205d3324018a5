"""Where a dataset's parquet files are, and a local copy of them.

    ./ttt-data                          a dataset folder (its data/*.parquet), or a folder of parquet files
    'codes/*.parquet'                   a glob of parquet files
    hf://datasets/ORG/NAME[/GLOB]       a Hub dataset, through the Hub's fsspec filesystem (the one
                                        `datasets` streaming uses); GLOB defaults to data/*.parquet
    s3://bucket/codes, file:///x, ...   any other fsspec URL, laid out like a dataset folder

`list_files` is what the streaming loader reads from. `local_copy` is what `ttt train --no-stream`
trains from: the Hub's own download API (`snapshot_download`, into the Hub's cache) for hf://,
fsspec for other URLs (into ~/.cache/ttt/datasets), and the folder itself for local datasets.
Both resume: files already copied whole are not fetched again.
"""

from __future__ import annotations

import functools
import glob
import os
from pathlib import Path, PurePosixPath
from typing import Any

from tqdm import tqdm

from pipeline.core.errors import UserError
from pipeline.core.files import sha256_bytes
from pipeline.core.hub import explain_hub_error, is_hub_url, parse_hub_url, retry_rate_limited
from pipeline.core.layout import DATA_DIR

DATASET_FILES = f"{DATA_DIR}/*.parquet"


class StreamError(UserError):
    """A dataset that cannot be found or read: reported as one line."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ttt" / "datasets"


def hub_filesystem() -> Any:
    try:
        from huggingface_hub import HfFileSystem
    except ImportError:
        raise StreamError("reading hf:// datasets needs huggingface_hub: pip install 'ttt[train]'") from None
    return HfFileSystem()


def list_files(source: str) -> tuple[Any, list[str]]:
    """The parquet files of a source, and the fsspec filesystem to open them with (None for local files)."""
    if is_hub_url(source):
        location = parse_hub_url(source, "dataset", allow_path=True)
        filesystem = hub_filesystem()
        pattern = location.fs_path if location.path else f"{location.fs_path}/{DATASET_FILES}"
    elif "://" in source:
        import fsspec

        filesystem, root = fsspec.core.url_to_fs(source)
        pattern = root if glob.has_magic(root) else f"{root.rstrip('/')}/{DATASET_FILES}"
    else:
        path = Path(source)
        pattern = str(path / DATASET_FILES) if path.is_dir() else source
        files = sorted(glob.glob(pattern))
        if not files and path.is_dir():  # a folder of parquet files without the data/ layout
            files = sorted(glob.glob(str(path / "*.parquet")))
        if not files:
            raise StreamError(f"no dataset at {source}: no parquet files found ({pattern}); run `ttt preprocess`?")
        return None, files
    try:  # the Hub's filesystem reads the repository's info first, a request huggingface_hub does not retry on 429
        files = sorted(retry_rate_limited(lambda: filesystem.glob(pattern)))
    except Exception as err:  # fsspec and the Hub raise many error types for missing repos
        raise StreamError(f"cannot list {source}: {explain_hub_error(err)}") from None
    if not files:
        raise StreamError(f"no dataset at {source}: no parquet files match {pattern}")
    return filesystem, files


def local_copy(source: str, cache_dir: Path | None = None) -> str:
    """A local source that holds the same files as `source`: copied once, then read from disk."""
    if "://" not in source:
        return source
    if is_hub_url(source):
        return hub_snapshot(source)
    return fsspec_copy(source, cache_dir or default_cache_dir())


def hub_snapshot(source: str) -> str:
    """Download a Hub dataset's parquet files with huggingface_hub (resumable, cached, offline when cached)."""
    location = parse_hub_url(source, "dataset", allow_path=True)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise StreamError("copying hf:// datasets needs huggingface_hub: pip install 'ttt[train]'") from None
    download = functools.partial(
        snapshot_download, location.repo_id, repo_type="dataset", allow_patterns=[location.path or DATASET_FILES]
    )
    try:  # it reads the repository's info first, a request huggingface_hub does not retry on 429
        folder = retry_rate_limited(download)
    except Exception as err:  # huggingface_hub raises HTTP, offline, auth and not-found errors alike
        raise StreamError(f"cannot download {source} from the Hub: {explain_hub_error(err)}") from None
    return str(Path(folder) / location.path) if location.path else folder


def fsspec_copy(source: str, cache_dir: Path) -> str:
    """Copy an fsspec dataset's parquet files into `cache_dir`, each file atomically; returns the local folder."""
    filesystem, files = list_files(source)
    folder = cache_dir / sha256_bytes(source.encode())[:16]
    for remote in tqdm(files, desc=f"copying {source}", unit="file", dynamic_ncols=True):
        local = folder / DATA_DIR / PurePosixPath(remote).name
        if local.is_file() and local.stat().st_size == filesystem.size(remote):
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f".{local.name}.partial-{os.getpid()}")
        try:
            filesystem.get_file(remote, str(partial))
            os.replace(partial, local)
        except OSError as err:
            raise StreamError(f"cannot copy {remote} from {source}: {err}") from None
        finally:
            partial.unlink(missing_ok=True)
    return str(folder)
