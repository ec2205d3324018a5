import pytest

from pipeline.preprocess.download import failure_reason


@pytest.mark.parametrize(
    "message, reason",
    [
        ("HTTP Error 404: Not Found", "HTTP 404"),
        ("HTTP Error 503: Service Unavailable", "HTTP 503"),
        ("<urlopen error timed out>", "timeout"),
        ("The read operation timed out", "timeout"),
        ("Image decoding error", "undecodable image"),
        ("cannot identify image file <_io.BytesIO object at 0x7f>", "undecodable image"),
        ("<urlopen error [Errno 111] Connection refused>", "connection error"),
        ("<urlopen error [Errno -2] Name or service not known>", "connection error"),
        ("Use of image disallowed by X-Robots-Tag directive", "disallowed by X-Robots-Tag"),
        ("something nobody expected", "other: something nobody expected"),
    ],
)
def test_img2dataset_errors_fold_into_countable_reasons(message, reason):
    assert failure_reason(message) == reason
