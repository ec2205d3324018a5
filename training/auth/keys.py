"""The run's authority key pair and the RSA keys and signatures every part of `ttt auth` uses.

The run's authority is an RSA key pair: `run.key` (PEM, readable by its owner only) signs access tokens and
revocation lists; `run.pub` (one OpenSSH line whose comment names the run) is what every peer checks them with.

Keys and signatures have hivemind's formats (OpenSSH public keys; base64 RSA-PSS-SHA256 signatures), made here
with `cryptography` alone: the organiser's commands and the auth server need neither hivemind nor torch.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import exceptions
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from pipeline.core.errors import UserError

AUTHORITY_PRIVATE = "run.key"
AUTHORITY_PUBLIC = "run.pub"
RUN_COMMENT = "ttt-run="  # the comment of run.pub: ttt-run=<run id>
PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)  # as hivemind signs


class AuthError(UserError):
    pass


@dataclass(frozen=True)
class PublicKey:
    key: rsa.RSAPublicKey

    @classmethod
    def from_bytes(cls, data: bytes) -> PublicKey:
        """An RSA public key in OpenSSH encoding (hivemind's); ValueError for anything else."""
        try:
            key = serialization.load_ssh_public_key(data)
        except (ValueError, TypeError, exceptions.UnsupportedAlgorithm) as err:
            raise ValueError(f"not an RSA public key ({err})") from None
        if not isinstance(key, rsa.RSAPublicKey):
            raise ValueError("not an RSA public key")
        return cls(key)

    def to_bytes(self) -> bytes:
        return self.key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    def verify(self, message: bytes, signature: bytes) -> bool:
        try:
            self.key.verify(base64.b64decode(signature), message, PSS, hashes.SHA256())
            return True
        except (ValueError, exceptions.InvalidSignature):
            return False


@dataclass(frozen=True)
class PrivateKey:
    key: rsa.RSAPrivateKey

    @classmethod
    def generate(cls) -> PrivateKey:
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    @property
    def public(self) -> PublicKey:
        return PublicKey(self.key.public_key())

    def sign(self, message: bytes) -> bytes:
        return base64.b64encode(self.key.sign(message, PSS, hashes.SHA256()))


def write_private(path: Path, data: bytes, mode: int) -> None:
    """Write a private key file that nobody else can read at any moment, atomically."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    os.chmod(temporary, mode)
    os.replace(temporary, path)


@dataclass(frozen=True)
class AuthorityPublicKey:
    run_id: str
    key: PublicKey
    source: str  # the file it came from, for messages

    def verify(self, message: bytes, signature: bytes) -> bool:
        return self.key.verify(message, signature)


@dataclass(frozen=True)
class Authority:
    """The run's authority: what `ttt auth issue`, `revoke` and `serve` sign with."""

    run_id: str
    key: PrivateKey
    folder: Path

    @property
    def public(self) -> AuthorityPublicKey:
        return AuthorityPublicKey(self.run_id, self.key.public, str(self.folder / AUTHORITY_PUBLIC))

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


def create_authority(folder: Path, run_id: str) -> Authority:
    private_path = folder / AUTHORITY_PRIVATE
    if private_path.exists():
        raise AuthError(f"{private_path} exists: one authority per run (remove it to start a new run's authority)")
    folder.mkdir(parents=True, exist_ok=True)
    key = PrivateKey.generate()
    pem = key.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private(private_path, pem, 0o600)
    (folder / AUTHORITY_PUBLIC).write_text(f"{key.public.to_bytes().decode()} {RUN_COMMENT}{run_id}\n")
    return Authority(run_id, key, folder)


def load_authority(folder: Path) -> Authority:
    private_path = folder / AUTHORITY_PRIVATE
    if not private_path.is_file():
        raise AuthError(f"--authority {folder} holds no {AUTHORITY_PRIVATE}; create it with `ttt auth init`")
    if private_path.stat().st_mode & 0o077:
        raise AuthError(f"{private_path} is readable by others; chmod 600 {private_path}")
    try:
        key = serialization.load_pem_private_key(private_path.read_bytes(), password=None)
    except (ValueError, TypeError, exceptions.UnsupportedAlgorithm):
        raise AuthError(f"{private_path} is not a PEM private key") from None
    public = load_authority_public_key(folder / AUTHORITY_PUBLIC)
    authority = Authority(public.run_id, PrivateKey(key), folder)
    if authority.public.key.to_bytes() != public.key.to_bytes():
        raise AuthError(f"{folder / AUTHORITY_PUBLIC} does not belong to {private_path}")
    return authority


def load_authority_public_key(path: Path) -> AuthorityPublicKey:
    """run.pub: `ssh-rsa AAAA... ttt-run=<run id>`."""
    try:
        return parse_authority_public_key(Path(path).read_text(), str(path))
    except FileNotFoundError:
        raise AuthError(f"--authority-key {path} does not exist; ask the run's organiser for run.pub") from None
    except (ValueError, UnicodeDecodeError):
        raise AuthError(f"--authority-key {path} is not a run's public key (run.pub from `ttt auth init`)") from None


def parse_authority_public_key(line: str, source: str) -> AuthorityPublicKey:
    """The line of a run.pub (`source`: where it came from, for messages); ValueError for anything else."""
    kind, body, comment = line.split()
    if not comment.startswith(RUN_COMMENT):
        raise ValueError("no run id")
    key = PublicKey.from_bytes(f"{kind} {body}".encode())
    return AuthorityPublicKey(comment.removeprefix(RUN_COMMENT), key, source)
