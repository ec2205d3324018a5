"""Code datasets made on the spot: the embedded sample through `ttt preprocess`'s own function, and files of random
codes at the paper's scale (32 x 32 codes from 8192) in the shard format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Console

from pipeline.core.shard_format import DatasetFacts, VQGANIdentity, build_shard_table, shard_path, shard_to_bytes

ROWS_PER_FILE = 1024
WORDS = "a photo of the red blue small large old new city beach dog cat on in with at night sunset tree".split()


def write_paper_scale(
    folder: Path, rows: int, rows_per_file: int = ROWS_PER_FILE, grid: int = 32, compression_level: int = 11
) -> None:
    """Files of grid x grid-code rows (uniform random codes from 8192; 32 x 32: 256 px at f=8, the paper's scale)
    with LAION-like captions, in row groups of 1,024 rows, Brotli at `compression_level`."""
    identity = VQGANIdentity("taming.models.vqgan.GumbelVQ", "model.yaml", "0" * 64, "0" * 64)
    facts = DatasetFacts(8192, grid, grid, 256, identity)
    rng = np.random.default_rng(0)
    files = rows // rows_per_file
    for index in range(files):
        keys = [f"{index:05d}{row:05d}" for row in range(rows_per_file)]
        captions = [" ".join(rng.choice(WORDS, int(rng.integers(5, 15)))) for _ in keys]
        columns = {
            "key": keys,
            "caption": captions,
            "url": [f"https://example.com/{k}.jpg" for k in keys],
            "original_width": [512] * len(keys),
            "original_height": [384] * len(keys),
            "NSFW": ["UNLIKELY"] * len(keys),
            "similarity": [0.31] * len(keys),
            "license": ["?"] * len(keys),
        }
        table = build_shard_table(columns, rng.integers(0, 8192, (len(keys), grid, grid)), facts)
        path = folder / shard_path(index, files)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(shard_to_bytes(table, compression_level))


def write_sample(folder: Path, rows: int) -> None:
    from pipeline.preprocess.run import PreprocessOptions, preprocess
    from tests.support.swarm_runs import free_port

    options = PreprocessOptions(output=str(folder), shards=8, sample_rows=rows, sample_port=free_port())
    preprocess(options, console=Console(quiet=True))
