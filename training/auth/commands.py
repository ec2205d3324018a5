"""The organiser's commands: `ttt auth init | keygen | add-user | issue | revoke | serve`."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from pipeline.core.console import ttt_console
from training.auth.keys import (
    AUTHORITY_PRIVATE,
    AUTHORITY_PUBLIC,
    AuthError,
    PublicKey,
    create_authority,
    load_authority,
)
from training.auth.server import AuthService, start_server
from training.auth.tokens import (
    TokenFile,
    issue_token,
    read_revocations,
    sign_revocations,
    write_revocations,
)
from training.auth.users import check_username, hash_password, read_allowlist, write_allowlist
from training.config import AuthServerSettings

console = ttt_console()


def init_authority(run_id: str, out: Path) -> None:
    authority = create_authority(out, run_id)
    console.print(
        f"run {authority.run_id!r}: private key {out / AUTHORITY_PRIVATE} (keep it secret, it admits peers), "
        f"public key {out / AUTHORITY_PUBLIC} (give it to every peer: --authority-key)"
    )


def make_peer_key(out: Path) -> None:
    """A peer key (--identity) and its public half, for a token issued offline."""
    if out.exists():
        raise AuthError(f"{out} exists; choose another --out or use that key")
    from training.auth.identity import new_peer_key, write_identity  # hivemind's key format: ttt[train]

    key = new_peer_key()
    write_identity(out, key)
    public = out.with_suffix(".pub")
    public.write_text(key.get_public_key().to_bytes().decode() + "\n")
    console.print(f"peer key {out} (train with --identity {out}); send {public} to the organiser for a token")


def add_user(username: str, allowlist: Path, password: str) -> None:
    users = read_allowlist(allowlist)
    existed = check_username(username) in users
    if len(password) < 8:
        raise AuthError("the password needs at least 8 characters")
    users[username] = hash_password(password)
    write_allowlist(allowlist, users)
    console.print(f"{'changed the password of' if existed else 'added'} {username} in {allowlist}")


def issue_offline(authority_folder: Path, username: str, peer_key: Path, out: Path, lifetime: float) -> None:
    authority = load_authority(authority_folder)
    check_username(username)
    if username in read_revocations(authority).revoked:
        raise AuthError(f"{username} is revoked in run {authority.run_id!r}; lift it first (ttt auth revoke --lift)")
    try:
        kind, body = peer_key.read_text().split()[:2]
        public_key = PublicKey.from_bytes(f"{kind} {body}".encode()).to_bytes()
    except (OSError, ValueError):
        raise AuthError(f"--peer-key {peer_key} is not a peer's public key (from `ttt auth keygen`)") from None
    token = issue_token(authority, username, public_key, lifetime)
    out.write_text(TokenFile(authority.run_id, token).to_json())
    console.print(f"token for {username} in run {authority.run_id!r}, valid until {token.expiration_time}: {out}")


def revoke(authority_folder: Path, username: str, lift: bool) -> None:
    authority = load_authority(authority_folder)
    revoked = dict(read_revocations(authority).revoked)
    if lift:
        if revoked.pop(username, None) is None:
            raise AuthError(f"{username} is not revoked in run {authority.run_id!r}")
    else:
        revoked.setdefault(check_username(username), time.time())
    write_revocations(authority, sign_revocations(authority, revoked))
    what = "may be admitted again" if lift else "is refused by every peer within one refresh period (--auth-refresh)"
    console.print(
        f"{username} {what}; revoked in run {authority.run_id!r}: {', '.join(revoked) or 'nobody'}. "
        "The auth server serves the new list at once and peers relay it."
    )


def serve(settings: AuthServerSettings) -> None:
    """Serve until Ctrl-C or SIGTERM."""
    if (settings.allowlist is None) == (settings.hf_org is None):
        raise AuthError("pass exactly one of --allowlist users.toml and --hf-org ORG: who this server admits")
    authority = load_authority(Path(settings.authority))
    if settings.allowlist and not Path(settings.allowlist).is_file():
        raise AuthError(f"--allowlist {settings.allowlist} does not exist; add users with `ttt auth add-user`")
    if bool(settings.certfile) != bool(settings.keyfile):
        raise AuthError("--certfile and --keyfile go together (HTTPS)")
    service = AuthService(authority, settings)
    server = start_server(service, settings)
    scheme = "https" if settings.certfile else "http"
    host, port = server.server_address[:2]
    admits = f"the allowlist {settings.allowlist}" if settings.allowlist else f"members of {settings.hf_org} on the Hub"
    lifetime = settings.token_lifetime
    lasting = f"{lifetime / 3600:g} h" if lifetime >= 3600 else f"{lifetime:g} s"
    console.print(
        f"auth server of run {authority.run_id!r} on {scheme}://{host}:{port}: admits {admits}; tokens last {lasting}"
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    console.print("auth server stopped")
