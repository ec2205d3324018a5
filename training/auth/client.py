"""What a peer asks the run's auth server (training/auth/server.py): a token, the revocation list, its key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from training.auth.keys import AuthError
from training.auth.tokens import RevocationList, Token, TokenFile

TIMEOUT = 10.0  # seconds per request


@dataclass(frozen=True)
class Login:
    """How a volunteer proves who they are: an allowlist password, or a Hugging Face read token."""

    username: str | None = None
    password: str | None = None
    hf_token: str | None = None

    def fields(self) -> dict:
        if self.username is not None:
            return {"username": self.username, "password": self.password or ""}
        return {"hf_token": self.hf_token or ""}


def call(server: str, path: str, body: dict | None = None) -> bytes:
    """One request; a refusal or an unreachable server becomes an AuthError with the server's own line."""
    url = server.rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.read()
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {err.code}"
        raise AuthError(f"the auth server {server} refused: {message}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise AuthError(f"cannot reach the auth server {server} ({reason}); check --auth-server") from None


def request_token(server: str, run_id: str, public_key: bytes, login: Login) -> Token:
    body = {"run_id": run_id, "public_key": public_key.decode(), **login.fields()}
    answer = call(server, "/api/token", body)  # an AuthError (a ValueError) must not be caught below
    try:
        token_file = TokenFile.from_json(json.dumps(json.loads(answer)["token"]))
    except (ValueError, KeyError, TypeError):
        raise AuthError(f"the auth server {server} sent something that is not a token") from None
    return token_file.token


def fetch_revocations(server: str) -> RevocationList:
    answer = call(server, "/api/revocations")
    try:
        return RevocationList.from_bytes(answer)
    except ValueError:
        raise AuthError(f"the auth server {server} sent something that is not a revocation list") from None


def fetch_authority_key(server: str) -> tuple[str, bytes]:
    """The run id and public key the server signs with."""
    answer = call(server, "/api/authority")
    try:
        fields = json.loads(answer)
        return str(fields["run_id"]), str(fields["public_key"]).encode()
    except (ValueError, KeyError, TypeError):
        raise AuthError(f"the auth server {server} does not say which authority it signs for") from None
