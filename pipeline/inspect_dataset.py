"""`ttt inspect`: what a published dataset holds, and its codes decoded back to images.

Reads only parquet footers for the facts and row counts, then the first N rows for the
grid. The VQGAN that decodes must be the one that encoded: its checkpoint sha256 is
checked against the dataset's facts. For captions of the embedded sample's grammar the
grid also shows the scene re-rendered from its caption, as the original to compare with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image, ImageDraw
from rich.console import Console
from rich.table import Table

from pipeline.errors import UserError
from pipeline.sample import render_scene
from pipeline.sample_judge import parse_caption
from pipeline.shard_format import DATA_DIR, DatasetFacts, binary_to_codes, read_facts
from pipeline.vqgan import VQGANSpec, decode, load_vqgan, tensor_to_images

CAPTION_HEIGHT = 28


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
    """Facts and row counts of a local dataset folder, from the parquet footers alone."""
    shards = sorted((folder / DATA_DIR).glob("*.parquet"))
    if not shards:
        raise InspectError(f"{folder} holds no {DATA_DIR}/*.parquet shards; is it a ttt dataset folder?")
    try:
        facts = [read_facts(path) for path in shards]
    except ValueError as err:
        raise InspectError(str(err)) from None
    if any(f != facts[0] for f in facts):
        raise InspectError(f"the shards of {folder} disagree about the dataset facts (mixed VQGANs or grids)")
    rows = {path.name: pq.ParquetFile(path).metadata.num_rows for path in shards}
    return DatasetOverview(folder, facts[0], rows)


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


def check_decoder(facts: DatasetFacts, spec: VQGANSpec) -> None:
    if spec.identity.ckpt_sha256 != facts.vqgan.ckpt_sha256 or spec.codebook_size != facts.codebook_size:
        raise InspectError(
            f"the dataset was encoded with {facts.vqgan.config_name} (checkpoint sha256 "
            f"{facts.vqgan.ckpt_sha256[:12]}..., {facts.codebook_size} codes) but the decoder is "
            f"{spec.config_path.name} ({spec.identity.ckpt_sha256[:12]}..., {spec.codebook_size} codes); "
            "pass the dataset's --vqgan-config/--vqgan-ckpt"
        )


def captioned_grid(columns: list[list[Image.Image]], captions: list[str], columns_per_row: int = 4) -> Image.Image:
    """Tiles of side-by-side images (e.g. original | decoded) with each tile's caption under it."""
    side = columns[0][0].width
    tile_width, tile_height = side * len(columns), side + CAPTION_HEIGHT
    rows = (len(captions) + columns_per_row - 1) // columns_per_row
    grid = Image.new("RGB", (tile_width * columns_per_row, tile_height * rows), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for index, caption in enumerate(captions):
        x, y = (index % columns_per_row) * tile_width, (index // columns_per_row) * tile_height
        for offset, images in enumerate(columns):
            grid.paste(images[index], (x + offset * side, y))
        words = (caption or "").split()
        half = (len(words) + 1) // 2
        draw.text((x + 2, y + side + 1), " ".join(words[:half]), fill=(0, 0, 0))
        draw.text((x + 2, y + side + 14), " ".join(words[half:]), fill=(0, 0, 0))
    return grid


def decode_grid(overview: DatasetOverview, spec: VQGANSpec, count: int, out: Path, device: str = "cpu") -> Path:
    """Decode the first `count` rows with the dataset's VQGAN and write a captioned PNG grid."""
    check_decoder(overview.facts, spec)
    facts = overview.facts
    captions, blobs = first_rows(overview.folder, count)
    codes = torch.from_numpy(np.stack([binary_to_codes(b, facts.grid_height, facts.grid_width) for b in blobs]))
    decoded = [Image.fromarray(p) for p in tensor_to_images(decode(load_vqgan(spec, device), codes))]
    scenes = [parse_caption(c or "") for c in captions]
    columns = [decoded]
    if all(scenes):  # the embedded sample's grammar: show the scene the caption describes beside it
        size = decoded[0].width
        columns.insert(0, [render_scene(scene, size, size) for scene in scenes])
    out.parent.mkdir(parents=True, exist_ok=True)
    captioned_grid(columns, captions).save(out)
    return out


def inspect_dataset(
    folder: Path,
    show: int,
    out: Path,
    vqgan_config: str | None = None,
    vqgan_ckpt: str | None = None,
    device: str = "auto",
    console: Console | None = None,
) -> DatasetOverview:
    """Print the dataset's facts and row counts; with `show` > 0, decode that many rows to a PNG grid."""
    from pipeline.vqgan import pick_device, vqgan_from_flags

    console = console or Console()
    found = overview(Path(folder))
    facts = found.facts
    table = Table(title=str(found.folder), show_header=False)
    table.add_row("rows", f"{found.rows:,} in {len(found.rows_per_shard)} shards")
    table.add_row("image size", f"{facts.image_size} px")
    table.add_row("code grid", f"{facts.grid_height} x {facts.grid_width}, codebook {facts.codebook_size}")
    table.add_row("VQGAN", f"{facts.vqgan.target} ({facts.vqgan.config_name})")
    table.add_row("VQGAN checkpoint sha256", facts.vqgan.ckpt_sha256)
    for name, rows in found.rows_per_shard.items():
        table.add_row(f"  {name}", f"{rows:,}")
    console.print(table)
    if show > 0:
        spec = vqgan_from_flags(vqgan_config, vqgan_ckpt)
        path = decode_grid(found, spec, min(show, found.rows), Path(out), pick_device(device))
        console.print(f"decoded {min(show, found.rows)} rows: {path}")
    return found
