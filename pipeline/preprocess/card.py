"""Stage 6: the data card, the output folder's README.md with the Hub's YAML header and the run's facts."""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path

from huggingface_hub import DatasetCard, DatasetCardData

from pipeline.core.files import write_atomic
from pipeline.core.filters import FilterConfig
from pipeline.core.layout import DATA_DIR, SPLIT
from pipeline.core.shard_format import ROW_SCHEMA, DatasetFacts
from pipeline.preprocess.report import RunSummary

CARD_NAME = "README.md"
SIZE_CATEGORIES = [
    (1_000, "n<1K"),
    (10_000, "1K<n<10K"),
    (100_000, "10K<n<100K"),
    (1_000_000, "100K<n<1M"),
    (10_000_000, "1M<n<10M"),
    (100_000_000, "10M<n<100M"),
    (1_000_000_000, "100M<n<1B"),
]
HF_DTYPES = {"string": "string", "binary": "binary", "int32": "int32", "double": "float64"}


def size_category(rows: int) -> str:
    return next((name for limit, name in SIZE_CATEGORIES if rows < limit), "1B<n<10B")


def describe_filters(config: FilterConfig) -> str:
    parts = [f"caption >= {config.min_caption_length} characters"]
    if config.require_positive_size:
        parts.append("positive width and height")
    if config.max_aspect_ratio is not None:
        parts.append(f"aspect ratio <= {config.max_aspect_ratio:g}")
    if config.allowed_nsfw is not None:
        parts.append(f"NSFW label in {{{', '.join(config.allowed_nsfw)}}}")
    if config.dedupe_urls:
        parts.append("first occurrence of each URL")
    return "; ".join(parts)


def render_card(
    facts: DatasetFacts,
    summary: RunSummary,
    filters: FilterConfig,
    input_description: str,
    command: str,
    license: str,
    pretty_name: str,
    load_path: str,
    vqgan_note: str | None = None,
) -> str:
    card_data = DatasetCardData(
        license=license,
        task_categories=["text-to-image"],
        size_categories=[size_category(summary.rows_written)],
        pretty_name=pretty_name,
        tags=["vqgan", "laion", "ttt"],
        configs=[{"config_name": "default", "data_files": [{"split": SPLIT, "path": f"{DATA_DIR}/{SPLIT}-*.parquet"}]}],
        dataset_info={
            "features": [{"name": f.name, "dtype": HF_DTYPES[str(f.type)]} for f in ROW_SCHEMA],
            "splits": [{"name": SPLIT, "num_bytes": summary.bytes_written, "num_examples": summary.rows_written}],
        },
    )
    template = resources.files("data_cards").joinpath("dataset_card.md").read_text(encoding="utf-8")
    card = DatasetCard.from_template(
        card_data,
        template_str=template,
        facts=facts,
        summary=summary,
        filtered=sorted(summary.filtered.items()),
        failed=sorted(summary.failed.items()),
        entropy_bound=facts.codes_per_image * math.log2(facts.codebook_size) / 8,
        filters_description=describe_filters(filters),
        input_description=input_description,
        command=command,
        load_path=load_path,
        vqgan_note=vqgan_note,
    )
    return str(card)


def write_card(folder: Path, text: str) -> None:
    write_atomic(folder / CARD_NAME, text.encode("utf-8"))
