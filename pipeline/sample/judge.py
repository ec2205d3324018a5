"""A judge for the embedded sample's domain: does an image show what its caption says?

It is derived from the generator's own ground truth (pipeline/sample.py): the palette, the
three shapes and where a relation puts them. It finds the coloured blobs on the dark
background, names each blob's colour (nearest palette colour) and shape (how much of its
bounding box it fills, and whether it widens downwards like the sample's triangles), and
checks the caption's objects and their relation against them. It is exact on the sample's
renderings and is what the VQGAN's and the generator's quality checks use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from PIL import Image
from scipy import ndimage

from pipeline.sample.domain import BACKGROUND, COLORS, RELATIONS, SHAPES, Scene, Shape

CAPTION = re.compile(
    rf"^a ({'|'.join(COLORS)}) ({'|'.join(SHAPES)})"
    rf"(?: ({'|'.join(RELATIONS)}) a ({'|'.join(COLORS)}) ({'|'.join(SHAPES)}))?$"
)
# A pixel belongs to a blob when it is this far (RGB distance) from the background...
FOREGROUND_DISTANCE = 80.0
# ...and a blob counts as an object when it covers at least this share of the image.
MIN_BLOB_FRACTION = 0.01
PALETTE_NAMES = list(COLORS)
PALETTE = np.array([COLORS[name] for name in PALETTE_NAMES], dtype=np.float32)


@dataclass(frozen=True)
class Blob:
    color: str
    shape: str
    centre: tuple[float, float]  # (x, y) as fractions of the image side
    area: float  # share of the image


@dataclass
class Verdict:
    match: bool
    reasons: list[str] = field(default_factory=list)  # why not, when it does not match
    blobs: list[Blob] = field(default_factory=list)


def parse_caption(caption: str) -> Scene | None:
    """The scene a sample caption describes, or None for a caption outside the sample's grammar."""
    found = CAPTION.match(caption.strip().lower())
    if not found:
        return None
    first = Shape(found.group(1), found.group(2))
    if found.group(3) is None:
        return Scene(first)
    return Scene(first, Shape(found.group(4), found.group(5)), found.group(3))


def classify_shape(mask: np.ndarray) -> str:
    """Square fills its bounding box, a circle ~pi/4 of it, the sample's triangle ~1/2 and widens downwards."""
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    box = mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    fill = box.mean()
    if fill > 0.9:
        return "square"
    widths = box.sum(axis=1)
    third = max(len(widths) // 3, 1)
    if fill < 0.65 and widths[-third:].mean() > 1.8 * widths[:third].mean():
        return "triangle"
    return "circle"


def find_blobs(image: Image.Image) -> list[Blob]:
    """The coloured objects in the image, largest first."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    height, width, _ = pixels.shape
    foreground = np.linalg.norm(pixels - np.array(BACKGROUND, np.float32), axis=2) > FOREGROUND_DISTANCE
    # Each foreground pixel takes its nearest palette colour; blobs are connected regions of one colour.
    nearest = np.linalg.norm(pixels[:, :, None, :] - PALETTE[None, None], axis=3).argmin(axis=2)
    blobs = []
    for color_index, name in enumerate(PALETTE_NAMES):
        labels, count = ndimage.label(foreground & (nearest == color_index))
        for label in range(1, count + 1):
            mask = labels == label
            area = mask.sum() / (height * width)
            if area < MIN_BLOB_FRACTION:
                continue
            ys, xs = np.nonzero(mask)
            centre = ((xs.mean() + 0.5) / width, (ys.mean() + 0.5) / height)
            blobs.append(Blob(name, classify_shape(mask), centre, float(area)))
    return sorted(blobs, key=lambda b: -b.area)


def relation_holds(relation: str, first: tuple[float, float], second: tuple[float, float]) -> bool:
    """Whether `first` is `relation` `second`: the offset along the relation's axis dominates."""
    dx, dy = first[0] - second[0], first[1] - second[1]
    return {
        "above": dy < 0 and abs(dy) > abs(dx),
        "below": dy > 0 and abs(dy) > abs(dx),
        "left of": dx < 0 and abs(dx) > abs(dy),
        "right of": dx > 0 and abs(dx) > abs(dy),
    }[relation]


def judge(image: Image.Image, caption: str) -> Verdict:
    """Does `image` show exactly the objects of `caption`, in the caption's arrangement?"""
    scene = parse_caption(caption)
    blobs = find_blobs(image)
    if scene is None:
        return Verdict(False, [f"caption {caption!r} is not in the sample's grammar"], blobs)
    wanted = [scene.first] + ([scene.second] if scene.second else [])
    reasons = []
    if len(blobs) != len(wanted):
        reasons.append(f"{len(blobs)} objects found, the caption has {len(wanted)}")
    matched = []
    for shape in wanted:
        candidates = [b for b in blobs if (b.color, b.shape) == (shape.color, shape.shape) and b not in matched]
        if not candidates:
            reasons.append(f"no {shape.color} {shape.shape}")
        else:
            matched.append(candidates[0])
    if (
        scene.second is not None
        and len(matched) == 2
        and not relation_holds(scene.relation, matched[0].centre, matched[1].centre)
    ):
        reasons.append(f"the {scene.first.color} {scene.first.shape} is not {scene.relation} the other")
    return Verdict(not reasons, reasons, blobs)
