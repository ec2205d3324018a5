"""`hf://` locations: the one parser for every place the tool reads from or writes to the Hugging Face Hub.

    hf://datasets/ORG/NAME              a dataset repository (ttt preprocess --output, ttt publish, ttt train)
    hf://datasets/ORG/NAME/data/*.parquet   files inside it, for the streaming loader
    hf://ORG/NAME                       a model repository (ttt generate --checkpoint)

The form is the one the Hub's own fsspec filesystem (`huggingface_hub.HfFileSystem`) reads,
so a location's `fs_path` can be handed to it as is.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

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
