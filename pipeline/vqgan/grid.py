"""Decoded images side by side with their captions, in one PNG: how `ttt inspect` and `ttt generate` show codes."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, ImageDraw

from pipeline.core.files import write_atomic

CAPTION_HEIGHT = 28  # two lines of PIL's default font under each tile


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


def write_png(image: Image.Image, path: Path) -> None:
    """Save `image` as a PNG atomically: a reader never finds half an image."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    write_atomic(path, buffer.getvalue())
