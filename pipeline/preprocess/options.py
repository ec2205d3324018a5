"""What `ttt preprocess` is configured with. Light on imports: the CLI takes its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.filters import FilterConfig
from pipeline.core.layout import DEFAULT_COMPRESSION_LEVEL, DEFAULT_DATASET
from pipeline.sample import DEFAULT_SAMPLE_PORT, DEFAULT_SAMPLE_ROWS


@dataclass(frozen=True)
class ColumnMap:
    """Names of the input columns; the defaults are LAION-400M's. None: the input has no such column."""

    key: str | None = "SAMPLE_ID"  # absent: a hash of the URL
    url: str | None = "URL"
    caption: str | None = "TEXT"
    width: str | None = "WIDTH"
    height: str | None = "HEIGHT"
    nsfw: str | None = "NSFW"
    similarity: str | None = "similarity"
    license: str | None = "LICENSE"


@dataclass
class PreprocessOptions:
    inputs: list[str] = field(default_factory=list)  # empty: the embedded sample
    input_format: str | None = None  # None: from the file suffix
    columns: ColumnMap = field(default_factory=ColumnMap)
    filters: FilterConfig = field(default_factory=FilterConfig)
    from_images: str | None = None  # an img2dataset output folder: skip the download
    output: str = DEFAULT_DATASET  # a folder, or hf://datasets/ORG/NAME
    local_dir: str | None = None  # where an hf:// output is staged; None: ./NAME
    shards: int = 8
    image_size: int | None = None  # None: 64 for the sample, 256 otherwise
    resize_mode: str = "center_crop"
    vqgan_config: str | None = None  # None (with vqgan_ckpt): the embedded sample's VQGAN
    vqgan_ckpt: str | None = None
    scheduler: str | None = None  # an existing Dask scheduler's address; None: a LocalCluster
    workers: int | None = None  # LocalCluster worker processes; None: one per core
    device: str = "auto"
    precision: str = "fp32"
    batch_size: int = 32  # images per encoder batch
    compression_level: int = DEFAULT_COMPRESSION_LEVEL
    timeout: float = 10.0  # download timeout per image, seconds
    retries: int = 0  # download retries per image
    download_threads: int = 128  # per shard task (img2dataset threads)
    sample_rows: int = DEFAULT_SAMPLE_ROWS
    sample_port: int = DEFAULT_SAMPLE_PORT
    sample_latency: float = 0.0  # seconds each sample image response waits (as a web host's would)
    overwrite: bool = False
    dry_run: bool = False
    as_json: bool = False  # also print the summary as JSON on stdout (`--json`)
    license: str = "other"  # license id for the data card
    command: str = "ttt preprocess"  # recorded in the data card
