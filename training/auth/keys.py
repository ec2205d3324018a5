"""The key files of an authenticated run, and the peer id a public key stands for.

The run's authority is an RSA key pair: `run.key` (PEM, readable by its owner only) signs access tokens and
revocation lists; `run.pub` (one OpenSSH line whose comment names the run) is what every peer checks them with.

A peer's key is its libp2p identity: an RSA key in the file format hivemind's p2p daemon reads (`--identity`).
The p2p layer authenticates every connection with it, and a peer id is a hash of its public key, so a token
that names the public key names the peer id too. The same key is hivemind's process-wide key, which signs
the peer's DHT requests and records.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from pipeline.core.errors import UserError

AUTHORITY_PRIVATE = "run.key"
AUTHORITY_PUBLIC = "run.pub"
RUN_COMMENT = "ttt-run="  # the comment of run.pub: ttt-run=<run id>
SHA256_MULTIHASH = bytes([0x12, 32])  # multihash prefix: sha2-256, 32 bytes


class AuthError(UserError):
    pass


def new_rsa_key() -> RSAPrivateKey:
    return RSAPrivateKey()


def hivemind_key(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    """hivemind's wrapper around a `cryptography` RSA key (the way its own unpickling builds one)."""
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped._private_key = key
    return wrapped


def public_key_text(key: RSAPrivateKey | RSAPublicKey) -> str:
    public = key.get_public_key() if isinstance(key, RSAPrivateKey) else key
    return public.to_bytes().decode()


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
    key: RSAPublicKey
    source: str  # the file it came from, for messages

    def verify(self, message: bytes, signature: bytes) -> bool:
        return self.key.verify(message, signature)


@dataclass(frozen=True)
class Authority:
    """The run's authority: what `ttt auth issue`, `revoke` and `serve` sign with."""

    run_id: str
    key: RSAPrivateKey
    folder: Path

    @property
    def public(self) -> AuthorityPublicKey:
        return AuthorityPublicKey(self.run_id, self.key.get_public_key(), str(self.folder / AUTHORITY_PUBLIC))

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)


def create_authority(folder: Path, run_id: str) -> Authority:
    private_path = folder / AUTHORITY_PRIVATE
    if private_path.exists():
        raise AuthError(f"{private_path} exists: one authority per run (remove it to start a new run's authority)")
    folder.mkdir(parents=True, exist_ok=True)
    key = new_rsa_key()
    pem = key._private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private(private_path, pem, 0o600)
    (folder / AUTHORITY_PUBLIC).write_text(f"{public_key_text(key)} {RUN_COMMENT}{run_id}\n")
    return Authority(run_id, key, folder)


def load_authority(folder: Path) -> Authority:
    private_path = folder / AUTHORITY_PRIVATE
    if not private_path.is_file():
        raise AuthError(f"--authority {folder} holds no {AUTHORITY_PRIVATE}; create it with `ttt auth init`")
    if private_path.stat().st_mode & 0o077:
        raise AuthError(f"{private_path} is readable by others; chmod 600 {private_path}")
    try:
        key = serialization.load_pem_private_key(private_path.read_bytes(), password=None)
    except ValueError:
        raise AuthError(f"{private_path} is not a PEM private key") from None
    public = load_authority_public_key(folder / AUTHORITY_PUBLIC)
    authority = Authority(public.run_id, hivemind_key(key), folder)
    if authority.public.key.to_bytes() != public.key.to_bytes():
        raise AuthError(f"{folder / AUTHORITY_PUBLIC} does not belong to {private_path}")
    return authority


def load_authority_public_key(path: Path) -> AuthorityPublicKey:
    """run.pub: `ssh-rsa AAAA... ttt-run=<run id>`."""
    try:
        kind, body, comment = Path(path).read_text().split()
        if not comment.startswith(RUN_COMMENT):
            raise ValueError("no run id")
        key = RSAPublicKey.from_bytes(f"{kind} {body}".encode())
    except FileNotFoundError:
        raise AuthError(f"--authority-key {path} does not exist; ask the run's organiser for run.pub") from None
    except (ValueError, TypeError):
        raise AuthError(f"--authority-key {path} is not a run's public key (run.pub from `ttt auth init`)") from None
    return AuthorityPublicKey(comment.removeprefix(RUN_COMMENT), key, str(path))


def write_identity(path: Path, key: RSAPrivateKey) -> None:
    """A peer key in the libp2p format that hivemind's p2p daemon reads, readable by its owner only."""
    protobuf = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes())
    write_private(path, protobuf.SerializeToString(), 0o400)


def load_identity(path: Path) -> RSAPrivateKey:
    try:
        protobuf = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        if protobuf.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = serialization.load_der_private_key(protobuf.data, password=None)
    except FileNotFoundError:
        raise AuthError(f"--identity {path} does not exist; make one with `ttt auth keygen --out {path}`") from None
    except Exception:  # protobuf and cryptography raise several types for a file of another kind
        raise AuthError(f"--identity {path} is not a peer key (make one with `ttt auth keygen`)") from None
    return hivemind_key(key)


def peer_id_of(public_key: bytes) -> PeerID:
    """The libp2p peer id of an RSA public key in hivemind's (OpenSSH) encoding."""
    der = RSAPublicKey.from_bytes(public_key)._public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    protobuf = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(SHA256_MULTIHASH + hashlib.sha256(protobuf).digest())


def use_as_process_key(key: RSAPrivateKey) -> None:
    """Make `key` hivemind's process-wide key: it then signs this peer's DHT requests and records, as the token
    bound to it requires. Call before anything of hivemind's reads the process-wide key."""
    RSAPrivateKey._process_wide_key = key
