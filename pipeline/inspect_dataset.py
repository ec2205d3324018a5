"""`ttt inspect`: what a published dataset holds, and its codes decoded back to images.

Reads only parquet footers for the facts and row counts, then the first N rows for the
grid. The VQGAN that decodes must be the one that encoded: its checkpoint sha256 is
checked against the dataset's facts. For captions of the embedded sample's grammar the
grid also shows the scene re-rendered from its caption, as the original to compare with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image
from rich.console import Console
from rich.table import Table

from pipeline.core.console import ttt_console
from pipeline.core.devices import pick_device
from pipeline.core.errors import UserError
from pipeline.core.layout import DATA_DIR
from pipeline.core.shard_format import DatasetFacts, binary_to_codes
from pipeline.core.stream import index_dataset
from pipeline.sample.domain import render_scene
from pipeline.sample.judge import parse_caption
from pipeline.vqgan.codec import VQGANSpec, check_same_vqgan, decode, load_vqgan, tensor_to_images, vqgan_from_flags
from pipeline.vqgan.grid import captioned_grid, write_png


class InspectError(UserError):
    pass


@dataclass
class DatasetOverview:
    folder: Path
    facts: DatasetFacts
    rows_per_shard: dict[str, int]

    @property
    def rows(self) -> int:
        return sum(self.rows_per_shard.values())


def overview(folder: Path) -> DatasetOverview:
    """Facts and row counts of a local dataset folder, from the parquet footers alone, read as the loader reads them."""
    if not any((folder / DATA_DIR).glob("*.parquet")):
        raise InspectError(f"{folder} holds no {DATA_DIR}/*.parquet shards; is it a ttt dataset folder?")
    index = index_dataset(str(folder))
    if index.facts is None:
        raise InspectError(f"{folder} has no ttt dataset facts in its shards; it was not made by `ttt preprocess`")
    rows = {Path(path).name: index.parquet(i).metadata.num_rows for i, path in enumerate(index.files)}
    return DatasetOverview(folder, index.facts, rows)


def first_rows(folder: Path, count: int) -> tuple[list[str], list[bytes]]:
    """Captions and code blobs of the first `count` rows, in shard order."""
    captions, codes = [], []
    for path in sorted((folder / DATA_DIR).glob("*.parquet")):
        table = pq.read_table(path, columns=["caption", "code"])
        captions += table.column("caption").to_pylist()[: count - len(captions)]
        codes += table.column("code").to_pylist()[: count - len(codes)]
        if len(captions) >= count:
            break
    return captions, codes


def decode_grid(overview: DatasetOverview, spec: VQGANSpec, count: int, out: Path, device: str = "cpu") -> Path:
    """Decode the first `count` rows with the dataset's VQGAN and write a captioned PNG grid."""
    facts = overview.facts
    check_same_vqgan(spec, facts.vqgan, "the dataset was encoded with")
    captions, blobs = first_rows(overview.folder, count)
    codes = torch.from_numpy(np.stack([binary_to_codes(b, facts.grid_height, facts.grid_width) for b in blobs]))
    decoded = [Image.fromarray(p) for p in tensor_to_images(decode(load_vqgan(spec, device), codes))]
    scenes = [parse_caption(c or "") for c in captions]
    columns = [decoded]
    if all(scenes):  # the embedded sample's grammar: show the scene the caption describes beside it
        size = decoded[0].width
        columns.insert(0, [render_scene(scene, size, size) for scene in scenes])
    write_png(captioned_grid(columns, captions), out)
    return out


def inspect_dataset(
    folder: Path,
    show: int,
    out_file: Path,
    vqgan_config: str | None = None,
    vqgan_ckpt: str | None = None,
    device: str = "auto",
    console: Console | None = None,
    as_json: bool = False,
) -> DatasetOverview:
    """Print the dataset's facts and row counts (`as_json`: as one JSON document on stdout, the rest on stderr);
    with `show` > 0, decode that many rows to a PNG grid."""
    console = console or ttt_console(stderr=as_json)
    found = overview(Path(folder))
    if not as_json:
        console.print(overview_table(found))
    decoded = None
    if show > 0:
        spec = vqgan_from_flags(vqgan_config, vqgan_ckpt)
        decoded = decode_grid(found, spec, min(show, found.rows), Path(out_file), pick_device(device))
        console.print(f"decoded {min(show, found.rows)} rows: {decoded}")
    if as_json:
        print(json.dumps(overview_document(found, decoded)), flush=True)
    return found


def overview_table(found: DatasetOverview) -> Table:
    facts = found.facts
    table = Table(title=str(found.folder), show_header=False)
    table.add_row("rows", f"{found.rows:,} in {len(found.rows_per_shard)} shards")
    table.add_row("image size", f"{facts.image_size} px")
    table.add_row("code grid", f"{facts.grid_height} x {facts.grid_width}, codebook {facts.codebook_size}")
    table.add_row("VQGAN", f"{facts.vqgan.target} ({facts.vqgan.config_name})")
    table.add_row("VQGAN checkpoint sha256", facts.vqgan.ckpt_sha256)
    for name, rows in found.rows_per_shard.items():
        table.add_row(f"  {name}", f"{rows:,}")
    return table


def overview_document(found: DatasetOverview, decoded: Path | None) -> dict:
    """What `ttt inspect --json` prints: the table's facts, and the grid it decoded (None: none)."""
    facts = found.facts
    return {
        "dataset": str(found.folder),
        "rows": found.rows,
        "shards": dict(found.rows_per_shard),
        "image_size": facts.image_size,
        "grid": [facts.grid_height, facts.grid_width],
        "codebook_size": facts.codebook_size,
        "vqgan": {
            "target": facts.vqgan.target, "config": facts.vqgan.config_name, "ckpt_sha256": facts.vqgan.ckpt_sha256
        },
        "decoded": str(decoded) if decoded else None,
    }
