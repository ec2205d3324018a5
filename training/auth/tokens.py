"""Access tokens and revocation lists: what the authority signs and what every peer checks.

A token says: `username` may take part in run `run_id` with the peer key `public_key` until `expires`. Its
fields are those of hivemind's `AccessToken` protobuf (username, public_key, expiration_time, signature), which
carries it between peers (training/auth/guard.py); the run id is not a field but part of what is signed, so a
token of another run fails the signature check. A token is useless
without its private key: DHT requests must be signed with that key, and averaging checks the caller's peer id,
which the p2p layer derives from the key it authenticated.

A revocation list names the usernames the organiser removed; the newest list (by `issued_at`) wins.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from training.auth.keys import AuthError, Authority, AuthorityPublicKey, PublicKey
from training.config import TOKEN_LIFETIME

REVOCATIONS = "revocations.json"  # in the authority's folder

# Why a token does not admit a peer: the names peers count and log refusals by.
NO_TOKEN = "no token"
MALFORMED = "malformed token"
WRONG_SIGNATURE = "not signed for this run by its authority"  # another run, another authority, or forged
EXPIRED = "expired"
REVOKED = "revoked"
OTHER_KEY = "presented with another peer's key"
REFUSALS = (NO_TOKEN, MALFORMED, WRONG_SIGNATURE, EXPIRED, REVOKED, OTHER_KEY)


def iso_time(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds")


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


@dataclass
class Token:
    """An access token's fields; hivemind's AccessToken protobuf has the same ones."""

    username: str = ""
    public_key: bytes = b""  # the peer's RSA key, OpenSSH encoding
    expiration_time: str = ""  # ISO 8601, UTC
    signature: bytes = b""  # the authority's, over signed_message


def signed_message(run_id: str, token: Token) -> bytes:
    header = f"ttt-access-token\n{run_id}\n{token.username}\n{token.expiration_time}\n"
    return header.encode() + token.public_key


def issue_token(authority: Authority, username: str, public_key: bytes, lifetime: float = TOKEN_LIFETIME) -> Token:
    token = Token(username=username, public_key=public_key, expiration_time=iso_time(time.time() + lifetime))
    token.signature = authority.sign(signed_message(authority.run_id, token))
    return token


@dataclass
class RevocationList:
    run_id: str
    issued_at: float = 0.0
    revoked: dict[str, float] = field(default_factory=dict)  # username -> when it was revoked
    signature: bytes = b""

    def body(self) -> bytes:
        fields = {"run_id": self.run_id, "issued_at": self.issued_at, "revoked": self.revoked}
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def to_bytes(self) -> bytes:
        fields = {"run_id": self.run_id, "issued_at": self.issued_at, "revoked": self.revoked}
        return json.dumps({**fields, "signature": self.signature.decode()}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RevocationList:
        """Raises ValueError for anything but a well-formed list (its signature is checked by `verified`)."""
        try:
            fields = json.loads(data)
            revoked = {str(user): float(at) for user, at in dict(fields["revoked"]).items()}
            return cls(str(fields["run_id"]), float(fields["issued_at"]), revoked, str(fields["signature"]).encode())
        except (KeyError, TypeError, AttributeError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a revocation list ({err})") from None

    def verified(self, authority: AuthorityPublicKey) -> bool:
        return self.run_id == authority.run_id and authority.verify(self.body(), self.signature)


def sign_revocations(authority: Authority, revoked: dict[str, float]) -> RevocationList:
    revocations = RevocationList(authority.run_id, time.time(), dict(sorted(revoked.items())))
    revocations.signature = authority.sign(revocations.body())
    return revocations


def read_revocations(authority: Authority) -> RevocationList:
    path = authority.folder / REVOCATIONS
    if not path.is_file():
        return RevocationList(authority.run_id)
    revocations = RevocationList.from_bytes(path.read_bytes())
    if not revocations.verified(authority.public):
        raise AuthError(f"{path} is not signed by this authority; remove it and revoke again")
    return revocations


def write_revocations(authority: Authority, revocations: RevocationList) -> None:
    path = authority.folder / REVOCATIONS
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(revocations.to_bytes())
    temporary.replace(path)


def token_refusal(
    token: Token, authority: AuthorityPublicKey, revoked: dict[str, float], now: float | None = None
) -> str | None:
    """Why `token` (a Token or an AccessToken protobuf) does not admit its holder to the authority's run (one of
    REFUSALS), or None if it does."""
    if not token.signature:
        return NO_TOKEN
    try:
        PublicKey.from_bytes(token.public_key)
        expires = parse_time(token.expiration_time)
    except (ValueError, TypeError):
        return MALFORMED
    if not authority.verify(signed_message(authority.run_id, token), token.signature):
        return WRONG_SIGNATURE
    if token.username in revoked:
        return REVOKED
    if expires <= (time.time() if now is None else now):
        return EXPIRED
    return None


@dataclass(frozen=True)
class TokenFile:
    """A token as `ttt auth issue` writes it and `--token` reads it: the token, and the run it names."""

    run_id: str
    token: Token

    def to_json(self) -> str:
        token = self.token
        fields = {
            "run_id": self.run_id,
            "username": token.username,
            "public_key": token.public_key.decode(),
            "expires": token.expiration_time,
            "signature": token.signature.decode(),
        }
        return json.dumps(fields, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> TokenFile:
        """Raises ValueError for anything but a token's fields."""
        try:
            fields = json.loads(text)
            token = Token(
                username=str(fields["username"]),
                public_key=str(fields["public_key"]).encode(),
                expiration_time=str(fields["expires"]),
                signature=str(fields["signature"]).encode(),
            )
            return cls(str(fields["run_id"]), token)
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a ttt access token ({err})") from None


def read_token_file(path: Path) -> TokenFile:
    try:
        return TokenFile.from_json(Path(path).read_text())
    except FileNotFoundError:
        raise AuthError(f"--token {path} does not exist") from None
    except (ValueError, UnicodeDecodeError):
        raise AuthError(f"--token {path} is not a token file (made by `ttt auth issue`)") from None


def check_own_token(token_file: TokenFile, authority: AuthorityPublicKey, public_key: bytes, source: str) -> None:
    """A volunteer's own token, checked before joining, with what to do about each problem."""
    token = token_file.token
    if token_file.run_id != authority.run_id:
        raise AuthError(
            f"{source} is for run {token_file.run_id!r}, and {authority.source} is the authority of run "
            f"{authority.run_id!r}: ask the organiser of {authority.run_id!r} for a token"
        )
    refusal = token_refusal(token, authority, {})
    if refusal == WRONG_SIGNATURE:
        raise AuthError(
            f"{source} was not signed by the authority key {authority.source}: the run's key changed, or the "
            "token comes from another organiser; get a new token, or the run's current run.pub"
        )
    if refusal == EXPIRED:
        raise AuthError(
            f"{source} expired at {token.expiration_time}: ask the organiser for a new one, or use --auth-server"
        )
    if refusal is not None:
        raise AuthError(f"{source} is a broken token ({refusal}): ask the organiser for a new one")
    if token.public_key != public_key:
        raise AuthError(
            f"{source} is bound to another peer key than this peer's (--identity): a token works only with the "
            "private key it was issued for"
        )
