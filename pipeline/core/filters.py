"""Stage 2: metadata filters. They live in the shared core because the streaming loader applies the same
rules on the fly to datasets that were not filtered (the public LAION code layout).

The paper dropped about 10% of LAION for short captions, extreme aspect ratios and NSFW
labels. Every rule is configurable, and every dropped row is counted under exactly one
reason: the first rule it fails, in the order below.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where rows are filtered: the streaming loader may never need it
    import pandas as pd

REASON_NO_URL = "missing URL"
REASON_SHORT_CAPTION = "caption too short"
REASON_BAD_SIZE = "non-positive width/height"
REASON_ASPECT_RATIO = "extreme aspect ratio"
REASON_NSFW = "NSFW label not allowed"
REASON_DUPLICATE_URL = "duplicate URL"


@dataclass(frozen=True)
class FilterConfig:
    """The filter rules; defaults are the paper's (caption >= 3 chars, aspect <= 2, NSFW == UNLIKELY)."""

    min_caption_length: int = 3
    max_aspect_ratio: float | None = 2.0  # None: no limit
    allowed_nsfw: tuple[str, ...] | None = ("UNLIKELY",)  # None: keep every label
    require_positive_size: bool = True
    dedupe_urls: bool = True

    @property
    def needs_size(self) -> bool:
        return self.require_positive_size or self.max_aspect_ratio is not None

    @property
    def needs_nsfw(self) -> bool:
        return self.allowed_nsfw is not None


def apply_filters(rows: pd.DataFrame, config: FilterConfig) -> tuple[pd.DataFrame, Counter]:
    """Return the rows that pass every rule (in input order) and the count of dropped rows by reason.

    `rows` has the canonical columns of `pipeline.preprocess.metadata` (url, caption, width, height, nsfw, ...).
    """
    import pandas as pd

    keep = pd.Series(True, index=rows.index)
    dropped: Counter = Counter()

    def drop(reason: str, failing: pd.Series) -> None:
        failing = failing & keep
        count = int(failing.sum())
        if count:
            dropped[reason] += count
        keep.loc[failing] = False

    url = rows["url"]
    drop(REASON_NO_URL, url.isna() | (url.fillna("").str.strip() == ""))
    caption_length = rows["caption"].fillna("").str.strip().str.len()
    drop(REASON_SHORT_CAPTION, caption_length < config.min_caption_length)
    if config.needs_size:
        width = pd.to_numeric(rows["width"], errors="coerce")
        height = pd.to_numeric(rows["height"], errors="coerce")
        if config.require_positive_size:
            drop(REASON_BAD_SIZE, ~((width > 0) & (height > 0)))
        if config.max_aspect_ratio is not None:
            ratio = pd.concat([width / height, height / width], axis=1).max(axis=1)
            drop(REASON_ASPECT_RATIO, ~(ratio <= config.max_aspect_ratio))
    if config.allowed_nsfw is not None:
        drop(REASON_NSFW, ~rows["nsfw"].isin(config.allowed_nsfw))
    if config.dedupe_urls:
        # Only rows still kept compete, so a URL is kept once, at its first surviving row.
        duplicated = pd.Series(False, index=rows.index)
        duplicated.loc[keep] = rows.loc[keep, "url"].duplicated(keep="first")
        drop(REASON_DUPLICATE_URL, duplicated)
    return rows.loc[keep].reset_index(drop=True), dropped
