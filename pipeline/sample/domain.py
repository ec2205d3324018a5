"""The embedded sample: a deterministic synthetic image-caption collection in LAION's format.

Images are coloured shapes with compositional captions ("a red circle above a blue
square"), so a trained model's output can be judged against the caption. Besides the
good rows, the collection holds rows that each filter and each failure path must catch
(short caption, zero size, extreme aspect ratio, NSFW label, duplicate URL, 404 URL,
corrupt image). The images are served from a local HTTP server on 127.0.0.1 for the
run, so the real download path (img2dataset) fetches them.
"""

from __future__ import annotations

import functools
import http.server
import io
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pipeline.sample import DEFAULT_SAMPLE_PORT, DEFAULT_SAMPLE_ROWS, MIN_SAMPLE_ROWS

DEFAULT_SEED = 0

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 200),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("above", "below", "left of", "right of")
BACKGROUND = (24, 24, 24)

# Rows that a filter or a failure path must catch, and how many of each per 100 rows.
DEFECTS = {
    "short caption": 2,
    "zero size": 1,
    "extreme aspect ratio": 2,
    "nsfw": 2,
    "duplicate url": 1,
    "http 404": 2,
    "corrupt image": 1,
}


@dataclass(frozen=True)
class Shape:
    color: str
    shape: str


@dataclass(frozen=True)
class Scene:
    """One or two shapes; with two, `relation` says where the first sits relative to the second."""

    first: Shape
    second: Shape | None = None
    relation: str | None = None

    @property
    def caption(self) -> str:
        text = f"a {self.first.color} {self.first.shape}"
        if self.second is not None:
            text += f" {self.relation} a {self.second.color} {self.second.shape}"
        return text


def random_scene(rng: np.random.Generator) -> Scene:
    def pick() -> Shape:
        return Shape(str(rng.choice(list(COLORS))), str(rng.choice(SHAPES)))

    first = pick()
    if rng.random() < 0.25:
        return Scene(first)
    second = pick()
    while second == first:
        second = pick()
    return Scene(first, second, str(rng.choice(RELATIONS)))


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, cx: float, cy: float, radius: float) -> None:
    color = COLORS[shape.color]
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape.shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape.shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(cx, cy - radius), (cx + radius, cy + radius), (cx - radius, cy + radius)], fill=color)


def shape_centres(scene: Scene) -> list[tuple[float, float]]:
    """Centres of the scene's shapes as fractions of the image side (the judge's ground truth)."""
    if scene.second is None:
        return [(0.5, 0.5)]
    near, far = 0.27, 0.73
    first, second = {
        "above": ((0.5, near), (0.5, far)),
        "below": ((0.5, far), (0.5, near)),
        "left of": ((near, 0.5), (far, 0.5)),
        "right of": ((far, 0.5), (near, 0.5)),
    }[scene.relation]
    return [first, second]


def render_scene(scene: Scene, width: int, height: int) -> Image.Image:
    """Draw the scene centred in a width x height canvas (the centre square holds the shapes)."""
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    side = min(width, height)
    left, top = (width - side) / 2, (height - side) / 2
    radius = side * (0.3 if scene.second is None else 0.19)
    shapes = [scene.first] + ([scene.second] if scene.second else [])
    for shape, (fx, fy) in zip(shapes, shape_centres(scene), strict=True):
        _draw_shape(draw, shape, left + fx * side, top + fy * side, radius)
    return image


def jpeg_round_trip(image: Image.Image, quality: int = 95) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def render_stored(scene: Scene, side: int, image_size: int) -> Image.Image:
    """The scene as `ttt preprocess` stores it: the sample's JPEG (q95) at `side` px, downscaled to
    `image_size` by area averaging (img2dataset's INTER_AREA), re-encoded as JPEG q95."""
    original = jpeg_round_trip(render_scene(scene, side, side))
    return jpeg_round_trip(original.resize((image_size, image_size), Image.BOX))


OPPOSITE_RELATION = {"below": "above", "right of": "left of"}


def is_heldout_layout(scene: Scene) -> bool:
    """One in ten scene layouts is held out: no row of the sample shows one and the sample VQGAN never trained on
    one. The held-out prompts (inference/sample_quality.py) are such layouts: a model draws them only by composing
    colours, shapes and relations it saw in other combinations.

    A layout is what the picture shows, so "a red circle above a blue square" and "a blue
    square below a red circle" are the same layout and fall on the same side of the split.
    """
    return zlib.crc32(layout(scene).caption.encode()) % 10 == 0


def layout(scene: Scene) -> Scene:
    """What the picture shows, phrased one way: a two-shape scene with "above" or "left of"."""
    if scene.relation in OPPOSITE_RELATION:
        return Scene(scene.second, scene.first, OPPOSITE_RELATION[scene.relation])
    return scene


def swapped_layout(scene: Scene) -> Scene:
    """The layout with the two shapes the other way round ("a red circle above a blue square": the blue square above
    the red circle)."""
    shown = layout(scene)
    return Scene(shown.second, shown.first, shown.relation)


def sample_scene(rng: np.random.Generator) -> Scene:
    """A scene for a row of the sample: a random one, never a held-out layout."""
    scene = random_scene(rng)
    while is_heldout_layout(scene):
        scene = random_scene(rng)
    return scene


def defect_plan(num_rows: int, seed: int = DEFAULT_SEED) -> list[str | None]:
    """Which rows carry which defect: a fixed share of each, at seeded positions (never row 0)."""
    rng = np.random.default_rng([seed, 1])
    plan: list[str | None] = [None] * num_rows
    slots = rng.permutation(np.arange(1, num_rows))
    position = 0
    for defect, per_hundred in DEFECTS.items():
        for _ in range(max(1, num_rows * per_hundred // 100)):
            plan[int(slots[position])] = defect
            position += 1
    return plan


def write_sample(folder: Path, base_url: str, num_rows: int = DEFAULT_SAMPLE_ROWS, seed: int = DEFAULT_SEED) -> Path:
    """Write the sample's images under folder/images and its LAION-format metadata parquet; return the parquet."""
    if num_rows < MIN_SAMPLE_ROWS:
        raise ValueError(f"the sample needs at least {MIN_SAMPLE_ROWS} rows so that every defect appears")
    rng = np.random.default_rng(seed)
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    plan = defect_plan(num_rows, seed)
    records = []
    last_clean_url = None
    for index, defect in enumerate(plan):
        scene = sample_scene(rng)
        side = int(rng.integers(96, 161))
        width, height = side, side
        name = f"{index:06d}.jpg"
        caption, nsfw = scene.caption, "UNLIKELY"
        if defect == "short caption":
            caption = "ok"
        elif defect == "zero size":
            width = 0
        elif defect == "extreme aspect ratio":
            width, height = side * 5, side
        elif defect == "nsfw":
            nsfw = "NSFW"
        if defect == "http 404":
            url = f"{base_url}/missing/{name}"
        elif defect == "duplicate url":
            url = last_clean_url
        else:
            url = f"{base_url}/images/{name}"
            if defect == "corrupt image":
                (images / name).write_bytes(b"this is not an image" * 8)
            else:
                render_scene(scene, max(width, 1), height).save(images / name, quality=95)
            if defect is None:
                last_clean_url = url
        records.append(
            {
                "SAMPLE_ID": 1_000_000 + index,
                "URL": url,
                "TEXT": caption,
                "HEIGHT": height,
                "WIDTH": width,
                "LICENSE": "CC0-1.0",
                "NSFW": nsfw,
                "similarity": round(float(rng.uniform(0.28, 0.4)), 4),
            }
        )
    import pandas as pd  # only the metadata writer needs it; the judge imports this module too

    path = folder / "metadata.parquet"
    pd.DataFrame.from_records(records).to_parquet(path, index=False)
    return path


class _SampleHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the sample's files quietly, each response after `latency` seconds, as a distant image host would."""

    def __init__(self, *args: object, latency: float, **kwargs: object) -> None:
        self.latency = latency  # set first: the base class handles the request inside __init__
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:
        time.sleep(self.latency)  # one thread per request (ThreadingHTTPServer): the delays overlap
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


class _SampleServer(http.server.ThreadingHTTPServer):
    # Every download task opens dozens of connections at once; the default backlog of 5
    # overflows and stalls clients for a SYN retransmission (1 s) each time.
    request_queue_size = 256


@contextmanager
def serve_folder(folder: Path, port: int = DEFAULT_SAMPLE_PORT, latency: float = 0.0) -> Iterator[str]:
    """Serve `folder` over HTTP on 127.0.0.1:port for the duration of the block; yields the base URL.

    `latency` delays every response by that many seconds, as web image hosts answer in 0.1 s to seconds.
    """
    handler = functools.partial(_SampleHandler, directory=str(folder), latency=latency)
    try:
        server = _SampleServer(("127.0.0.1", port), handler)
    except OSError as err:
        raise OSError(f"cannot serve the sample on 127.0.0.1:{port} ({err.strerror}); pass --sample-port") from None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
