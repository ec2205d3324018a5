"""The allowlist (users.toml): who may ask the auth server for a token, with salted password hashes.

    [users.alice]
    password = "scrypt:16384:8:1:<salt>:<hash>"

Passwords are never stored, only scrypt hashes with a random salt per user (hashlib, stdlib).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import sys
from pathlib import Path

from training.auth.keys import AuthError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

USERNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SCRYPT = {"n": 2**14, "r": 8, "p": 1}


def check_username(username: str) -> str:
    if not USERNAME.fullmatch(username):
        raise AuthError(
            f"username {username!r} is not allowed: 1-64 letters, digits, '_', '.' or '-', starting with a letter "
            "or digit"
        )
    return username


def hash_password(password: str) -> str:
    salt = os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, **SCRYPT)
    encode = base64.b64encode
    return f"scrypt:{SCRYPT['n']}:{SCRYPT['r']}:{SCRYPT['p']}:{encode(salt).decode()}:{encode(digest).decode()}"


def password_matches(password: str, stored: str) -> bool:
    try:
        _, n, r, p, salt, digest = stored.split(":")
        expected = base64.b64decode(digest)
        found = hashlib.scrypt(password.encode(), salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p))
    except ValueError:
        return False
    return hmac.compare_digest(found, expected)


def read_allowlist(path: Path) -> dict[str, str]:
    """username -> stored password hash; a missing file is an empty allowlist."""
    if not path.exists():
        return {}
    try:
        users = tomllib.loads(path.read_text()).get("users", {})
        return {check_username(name): str(entry["password"]) for name, entry in users.items()}
    except (tomllib.TOMLDecodeError, KeyError, TypeError, AttributeError, AuthError) as err:
        raise AuthError(
            f"--allowlist {path} is not an allowlist ({err}); rebuild it with `ttt auth add-user`"
        ) from None


def write_allowlist(path: Path, users: dict[str, str]) -> None:
    lines = ["# ttt auth allowlist: who may ask this run's auth server for a token (salted scrypt hashes)\n"]
    for name, stored in sorted(users.items()):
        lines.append(f'\n[users."{check_username(name)}"]\npassword = "{stored}"\n')
    temporary = path.with_name(path.name + ".tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write("".join(lines))
    temporary.replace(path)
