"""A peer's key: its libp2p identity, the key its token names, and hivemind's process-wide key, all one RSA key.

The p2p layer authenticates every connection with the identity key, and a peer id is a hash of its public key,
so a token that names the public key names the peer id too. As hivemind's process-wide key, the same key signs
the peer's DHT requests (the token protocol checks them against the token's key) and its DHT records.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from training.auth.keys import AuthError, PublicKey, write_private
from training.swarm.authorizer import wrap_private_key

SHA256_MULTIHASH = bytes([0x12, 32])  # multihash prefix: sha2-256, 32 bytes


def new_peer_key() -> RSAPrivateKey:
    return RSAPrivateKey()


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
        raise AuthError(
            f"--identity {path} does not exist; make one with `ttt auth keygen --out-file {path}`"
        ) from None
    except Exception:  # protobuf and cryptography raise several types for a file of another kind
        raise AuthError(f"--identity {path} is not an RSA peer key (make one with `ttt auth keygen`)") from None
    return wrap_private_key(key)


def peer_id_of(public_key: bytes) -> PeerID:
    """The libp2p peer id of an RSA public key in hivemind's (OpenSSH) encoding."""
    der = PublicKey.from_bytes(public_key).key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    protobuf = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(SHA256_MULTIHASH + hashlib.sha256(protobuf).digest())
