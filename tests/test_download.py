import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline.preprocess.download import failure_reason
from pipeline.sample.domain import serve_folder


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


def test_the_sample_server_answers_late_and_many_requests_at_once(tmp_path):
    (tmp_path / "image.jpg").write_bytes(b"an image")
    latency, requests = 0.3, 16
    with serve_folder(tmp_path, port=0, latency=latency) as base_url:

        def fetch(_: int) -> tuple[float, bytes]:
            start = time.perf_counter()
            with urllib.request.urlopen(f"{base_url}/image.jpg") as response:
                return time.perf_counter() - start, response.read()

        start = time.perf_counter()
        with ThreadPoolExecutor(requests) as pool:
            answers = list(pool.map(fetch, range(requests)))
        total = time.perf_counter() - start
    assert all(seconds >= latency and data == b"an image" for seconds, data in answers)
    assert total < requests * latency / 2  # the delays overlap (one after another they would take 4.8 s)
