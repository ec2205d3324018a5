"""`hf://` locations: the one parser for every place the tool reads from or writes to the Hugging Face Hub.

    hf://datasets/ORG/NAME              a dataset repository (ttt preprocess --dataset, ttt publish, ttt train)
    hf://datasets/ORG/NAME/data/*.parquet   files inside it, for the streaming loader
    hf://ORG/NAME                       a model repository (ttt generate --checkpoint)

The form is the one the Hub's own fsspec filesystem (`huggingface_hub.HfFileSystem`) reads,
so a location's `fs_path` can be handed to it as is.

The rest is what every caller of the Hub shares: the token, one line for any error huggingface_hub raises
(`explain_hub_error`), and waiting out the Hub's rate limit where huggingface_hub does not (`retry_rate_limited`:
it retries 429 on uploads, downloads and listings itself, but not on creating a repository, reading its info or
committing). huggingface_hub itself is never imported here: the errors are read by their attributes.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote

from pipeline.core.errors import UserError

SCHEME = "hf://"
FORMS = {"dataset": "hf://datasets/ORG/NAME", "model": "hf://ORG/NAME"}
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_LOCATION = re.compile(rf"hf://(datasets/)?({_NAME})/({_NAME})(?:/(.*))?")


class HubLocationError(UserError):
    pass


@dataclass(frozen=True)
class HubLocation:
    repo_type: str  # "dataset" or "model", as huggingface_hub names them
    repo_id: str  # ORG/NAME
    path: str = ""  # inside the repository; "" for the repository itself

    @property
    def fs_path(self) -> str:
        """The location as HfFileSystem names it (datasets/ORG/NAME/..., or ORG/NAME/... for models)."""
        prefix = "datasets/" if self.repo_type == "dataset" else ""
        return f"{prefix}{self.repo_id}" + (f"/{self.path}" if self.path else "")


def is_hub_url(text: str) -> bool:
    return text.startswith(SCHEME)


def parse_hub_url(url: str, repo_type: str, allow_path: bool = False) -> HubLocation:
    """Parse `url` as a location of a `repo_type` repository; anything else is one error naming the expected form.

    A string that starts with hf:// but does not have the form is a typo, not a local path: it raises
    instead of silently writing to a folder called "hf:".
    """
    found = _LOCATION.fullmatch(url.rstrip("/"))
    found_type = "dataset" if found and found.group(1) else "model"
    path = (found.group(4) or "") if found else ""
    if (
        found is None
        or found_type != repo_type
        or (path and not allow_path)
        or found.group(2) in ("datasets", "models")
    ):
        expected = FORMS[repo_type] + ("[/PATH]" if allow_path else "")
        raise HubLocationError(f"bad Hub location {url!r}: expected {expected}")
    return HubLocation(repo_type, f"{found.group(2)}/{found.group(3)}", path)


def hub_token(token: str | None = None) -> str | None:
    """An explicit token wins, else $HF_TOKEN; an empty string counts as missing."""
    if token:
        return token
    return os.environ.get("HF_TOKEN") or None


TOKENS_PAGE = "https://huggingface.co/settings/tokens"
RATE_LIMIT_ATTEMPTS = 5
RATE_LIMIT_MAX_WAIT = 120  # seconds; a longer Retry-After is reported, not slept through
RATE_LIMIT_DEFAULT_WAIT = 10  # seconds, when a 429 does not say
T = TypeVar("T")


def _http_error(err: BaseException) -> Any | None:
    """The error that carries the Hub's HTTP answer (`.response`), if any: huggingface_hub raises HfHubHTTPError
    and its subclasses; HfFileSystem and hf_hub_download raise FileNotFoundError or LocalEntryNotFoundError *from*
    one."""
    cause: BaseException | None = err
    while cause is not None:
        if hasattr(getattr(cause, "response", None), "status_code"):
            return cause
        cause = cause.__cause__
    return None


def retry_after(err: BaseException) -> int | None:
    """The seconds a rate-limited request (429) should wait before it is sent again; None for other errors."""
    http_error = _http_error(err)
    if http_error is None or http_error.response.status_code != 429:
        return None
    response = http_error.response
    value = response.headers.get("Retry-After", "")
    if value.isdigit():
        return int(value)
    window = re.search(r";\s*t\s*=\s*(\d+)", response.headers.get("RateLimit", ""))  # "api";r=0;t=55
    return int(window.group(1)) if window else RATE_LIMIT_DEFAULT_WAIT


def hub_error_is_lasting(err: BaseException) -> bool:
    """True for a refusal that running the same command again cannot change (token, access, missing repo or
    file); network failures, server errors and rate limits pass."""
    http_error = _http_error(err)
    status = None if http_error is None else http_error.response.status_code
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def explain_hub_error(err: BaseException) -> str:
    """One line for an error from talking to the Hub: what it refused, in its words, and what to do about it."""
    http_error = _http_error(err)
    if http_error is None:  # no answer: a network failure, a dropped connection, an offline cache miss
        lines = str(err).strip().splitlines()
        return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    response = http_error.response
    status, said = response.status_code, response.headers.get("X-Error-Message") or response.reason_phrase
    kinds = {kind.__name__ for kind in type(http_error).__mro__}  # as huggingface_hub classified the answer
    if "RepositoryNotFoundError" in kinds:
        return f"not found on the Hub, or private and the token may not read it ({status} {said})"
    if "EntryNotFoundError" in kinds:
        path = re.search(r"/resolve/[^/]+/([^?]+)", str(response.url))
        return f"the Hub has no {unquote(path.group(1)) if path else 'such file'} there ({status} {said})"
    if status == 401:
        return f"the Hub refused the token ({status} {said}); set HF_TOKEN to a valid token from {TOKENS_PAGE}"
    if status == 403:
        return f"the token may not do this ({status} {said}); publishing and pushing need a token with write access"
    if status == 429:
        return f"the Hub is rate limiting this client ({status} {said}); try again in {retry_after(err)} s"
    return f"the Hub answered {status} {said}"


def retry_rate_limited(
    call: Callable[[], T],
    echo: Callable[[str], Any] = lambda line: print(line, file=sys.stderr),
    attempts: int = RATE_LIMIT_ATTEMPTS,
) -> T:
    """`call()`, sent again after the wait the Hub asks for when it answers 429, a few times; a wait longer than
    RATE_LIMIT_MAX_WAIT, or the last attempt, raises the error for the caller to report."""
    attempt = 1
    while True:
        try:
            return call()
        except Exception as err:
            wait = retry_after(err)
            if wait is None or wait > RATE_LIMIT_MAX_WAIT or attempt == attempts:
                raise
        echo(f"the Hub is rate limiting this client (429); waiting {wait} s (attempt {attempt} of {attempts})")
        time.sleep(wait)
        attempt += 1
