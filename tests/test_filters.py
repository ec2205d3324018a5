from collections import Counter

import pandas as pd

from pipeline.core.filters import (
    REASON_ASPECT_RATIO,
    REASON_BAD_SIZE,
    REASON_DUPLICATE_URL,
    REASON_NO_URL,
    REASON_NSFW,
    REASON_SHORT_CAPTION,
    FilterConfig,
    apply_filters,
)


def rows(*records):
    columns = ["key", "url", "caption", "width", "height", "nsfw", "similarity", "license"]
    frame = pd.DataFrame.from_records(
        [dict(zip(["url", "caption", "width", "height", "nsfw"], r, strict=True)) for r in records]
    )
    frame["key"] = [str(i) for i in range(len(frame))]
    return frame.reindex(columns=columns)


def test_each_rule_counts_its_own_reason():
    data = rows(
        ("http://a/1", "a red circle", 100, 100, "UNLIKELY"),  # kept
        (None, "a red circle", 100, 100, "UNLIKELY"),  # no URL
        ("http://a/2", "ab", 100, 100, "UNLIKELY"),  # caption too short
        ("http://a/3", "a blue square", 0, 100, "UNLIKELY"),  # zero width
        ("http://a/4", "a blue square", 300, 100, "UNLIKELY"),  # aspect 3 > 2
        ("http://a/5", "a blue square", 100, 100, "NSFW"),  # label
        ("http://a/1", "another caption", 100, 100, "UNLIKELY"),  # duplicate of row 0
        ("http://a/6", "exactly two", 200, 100, "UNLIKELY"),  # aspect exactly 2: kept
    )
    kept, dropped = apply_filters(data, FilterConfig())
    assert kept["url"].tolist() == ["http://a/1", "http://a/6"]
    assert dropped == Counter(
        {
            REASON_NO_URL: 1,
            REASON_SHORT_CAPTION: 1,
            REASON_BAD_SIZE: 1,
            REASON_ASPECT_RATIO: 1,
            REASON_NSFW: 1,
            REASON_DUPLICATE_URL: 1,
        }
    )
    assert len(kept) + sum(dropped.values()) == len(data)


def test_a_row_is_counted_once_under_its_first_failing_rule():
    data = rows(("http://a/1", "x", 0, 0, "NSFW"))
    _, dropped = apply_filters(data, FilterConfig())
    assert dropped == Counter({REASON_SHORT_CAPTION: 1})


def test_duplicate_keeps_first_surviving_occurrence():
    # The first occurrence fails another rule, so the second one is the one kept.
    data = rows(
        ("http://a/1", "no", 100, 100, "UNLIKELY"),
        ("http://a/1", "a good caption", 100, 100, "UNLIKELY"),
        ("http://a/1", "a third caption", 100, 100, "UNLIKELY"),
    )
    kept, dropped = apply_filters(data, FilterConfig())
    assert kept["caption"].tolist() == ["a good caption"]
    assert dropped == Counter({REASON_SHORT_CAPTION: 1, REASON_DUPLICATE_URL: 1})


def test_rules_can_be_relaxed():
    data = rows(
        ("http://a/1", "ab", 1000, 10, "NSFW"),
        ("http://a/1", "ab", 0, 10, "UNSURE"),
    )
    config = FilterConfig(
        min_caption_length=0, max_aspect_ratio=None, allowed_nsfw=None, require_positive_size=False, dedupe_urls=False
    )
    kept, dropped = apply_filters(data, config)
    assert len(kept) == 2 and not dropped


def test_allowed_nsfw_labels_and_missing_sizes():
    data = rows(
        ("http://a/1", "a caption", 10, 10, "UNSURE"),
        ("http://a/2", "a caption", None, 10, "UNLIKELY"),
        ("http://a/3", "a caption", 10, 10, None),
    )
    kept, dropped = apply_filters(data, FilterConfig(allowed_nsfw=("UNLIKELY", "UNSURE")))
    assert kept["url"].tolist() == ["http://a/1"]
    assert dropped == Counter({REASON_BAD_SIZE: 1, REASON_NSFW: 1})
