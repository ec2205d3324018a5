"""What runs inside a peer of an authenticated run.

    main process   RunAccess: the peer's key and token; a keeper thread renews the token from the auth server
                   before it expires and fetches the revocation list; `tick()` (from the training loop) publishes
                   the peer's credential and relays the newest revocation list through the DHT
        | shared memory (forked): the current token, the current revocation list, the refusal counts
    DHT process    TokenAuthorizer: hivemind's token protocol on every DHT request and response
    averagers      AdmittedOnly: joining a group, all-reduce parts and state downloads are answered only for a
                   caller whose peer id (authenticated by libp2p) holds a valid credential in the DHT

A credential is a peer's token stored under `{run_id}_credentials`, subkey the peer's own public key (only its
owner can write it). The token names the public key, and the public key determines the peer id, so a peer
cannot present another's token: DHT requests must be signed with the token's key, and averaging callers must
be the token's peer id.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from rich.console import Console

from pipeline.core.hub import hub_token
from training.auth.client import Login, fetch_authority_key, fetch_revocations, request_token
from training.auth.identity import load_identity, new_peer_key, peer_id_of, write_identity
from training.auth.keys import AuthError, AuthorityPublicKey, load_authority_public_key
from training.auth.tokens import (
    EXPIRED,
    NO_TOKEN,
    REVOKED,
    RevocationList,
    Token,
    TokenFile,
    check_own_token,
    parse_time,
    read_token_file,
    token_refusal,
)
from training.config import AuthSettings, MonitorSettings, PeerSettings
from training.metrics import credentials_key, read_latest, revocations_key
from training.swarm.authorizer import TokenAuthorizer, use_as_process_key

REQUESTS = ("dht", "join_group", "aggregate_part", "download_state")  # what a peer counts refusals of
RENEW_AT = 1 / 2  # renew a token when this share of its lifetime is left (clocks of peers differ)
LOOKUP_INTERVAL = 1.0  # seconds between two DHT reads of the credentials that one caller can cause
LOG_EVERY = 60.0  # seconds between two log lines about the same caller, request and reason
SHARED_BYTES = 256 * 1024  # room for the token and the revocation list in shared memory
RELAY_LIFETIME = 7 * 24 * 3600.0  # seconds a relayed revocation list stays in the DHT unless stored again


def as_proto(token: Token) -> AccessToken:
    """A token as hivemind's AccessToken protobuf, the form peers exchange it in."""
    return AccessToken(
        username=token.username,
        public_key=token.public_key,
        expiration_time=token.expiration_time,
        signature=token.signature,
    )


class SharedBytes:
    """Bytes the main process writes and the peer's forked hivemind processes read, with a version number."""

    def __init__(self) -> None:
        self.lock = mp.Lock()
        self.buffer = mp.RawArray("c", SHARED_BYTES)
        self.length, self.version = mp.RawValue("q", 0), mp.RawValue("q", 0)

    def write(self, data: bytes) -> None:
        if len(data) > SHARED_BYTES:
            raise AuthError(f"{len(data)} bytes do not fit the {SHARED_BYTES} shared for the token and revocations")
        with self.lock:
            self.buffer[: len(data)] = data
            self.length.value = len(data)
            self.version.value += 1

    def read(self) -> tuple[int, bytes]:
        with self.lock:
            return self.version.value, self.buffer[: self.length.value]


class AccessState:
    """What the peer's processes share: the authority, its own token, the revocation list, the refusal counts."""

    def __init__(self, run_id: str, authority: AuthorityPublicKey) -> None:
        self.run_id, self.authority = run_id, authority
        self.own_token, self.revocation_list = SharedBytes(), SharedBytes()
        self.refused = mp.RawArray("q", len(REQUESTS))
        self.refused_lock = mp.Lock()
        self.seen_revocations: tuple[int, RevocationList] = (-1, RevocationList(run_id))  # per process
        self.logged: dict[tuple[str, str, str], float] = {}  # per process

    def token(self) -> AccessToken:
        return AccessToken.FromString(self.own_token.read()[1])

    def revocations(self) -> RevocationList:
        """The current list; parsed again only when the main process changed it."""
        version = self.revocation_list.version.value
        if version != self.seen_revocations[0]:
            _, data = self.revocation_list.read()
            revocations = RevocationList.from_bytes(data) if data else RevocationList(self.run_id)
            self.seen_revocations = (version, revocations)
        return self.seen_revocations[1]

    def refusal(self, token: AccessToken) -> str | None:
        return token_refusal(token, self.authority, self.revocations().revoked, now=get_dht_time())

    def count(self, request: str, caller: str, reason: str) -> None:
        """Count a refused request and say so on stderr (once a minute per caller, request and reason)."""
        with self.refused_lock:
            self.refused[REQUESTS.index(request)] += 1
        now = time.monotonic()
        if now - self.logged.get((request, caller, reason), -LOG_EVERY) >= LOG_EVERY:
            self.logged[(request, caller, reason)] = now
            # One write: the peer's processes share its stderr, and print() writes the text and the newline apart.
            sys.stderr.write(f"auth: refused {request} from {caller}: {reason}\n")
            sys.stderr.flush()

    def refused_counts(self) -> dict[str, int]:
        with self.refused_lock:
            return dict(zip(REQUESTS, self.refused[:], strict=True))


class AdmittedPeers:
    """The averaging check (in an averager's process): does this peer id hold a valid credential?"""

    def __init__(self, state: AccessState) -> None:
        self.state = state
        self.tokens: dict[PeerID, AccessToken] = {}  # per process: the newest credential read of each peer
        self.looked_up: dict[PeerID, float] = {}  # when a caller last made this process read the credentials

    async def check(self, caller: PeerID, request: str, dht) -> None:
        """Return if `caller` is admitted; count, log and raise PermissionError if not."""
        reason = self.reason(caller)
        if reason is not None:
            await self.lookup(caller, dht)  # a newcomer's credential, or a renewed token, may not have been read yet
            reason = self.reason(caller)
        if reason is not None:
            token = self.tokens.get(caller)
            who = f"{caller}" + (f" ({token.username})" if token is not None and token.username else "")
            self.state.count(request, who, reason)
            raise PermissionError(f"peer {caller} is not admitted to run {self.state.run_id!r}: {reason}")

    def reason(self, caller: PeerID) -> str | None:
        token = self.tokens.get(caller)
        return NO_TOKEN if token is None else self.state.refusal(token)

    async def lookup(self, caller: PeerID, dht) -> None:
        """Read every credential of the run, at most once per LOOKUP_INTERVAL for one caller: a flood of unknown
        callers costs a read per caller and second, and never delays reading an admitted peer's renewed token."""
        now = time.monotonic()
        if now - self.looked_up.get(caller, -LOOKUP_INTERVAL) < LOOKUP_INTERVAL:
            return
        if len(self.looked_up) > 10_000:
            self.looked_up = {peer: at for peer, at in self.looked_up.items() if now - at < LOOKUP_INTERVAL}
        self.looked_up[caller] = now
        found = await read_latest(dht, credentials_key(self.state.run_id), return_future=True)
        for peer_id, token in read_credentials(found).items():
            known = self.tokens.get(peer_id)
            if known is None or parse_time(token.expiration_time) > parse_time(known.expiration_time):
                self.tokens[peer_id] = token


def read_credentials(found) -> dict[PeerID, AccessToken]:
    """The tokens of a `dht.get` of the credentials key, by the peer id their key stands for; a token stored under
    a subkey that is not its own key is skipped."""
    tokens = {}
    if found is None or not isinstance(found.value, dict):
        return tokens
    for subkey, entry in found.value.items():
        try:
            token = AccessToken.FromString(entry.value)
            if bytes(subkey) != owner_subkey(token.public_key):
                continue
            tokens[peer_id_of(token.public_key)] = token
        except Exception:  # the schema validator only lets bytes in; anything else in them is skipped
            continue
    return tokens


def owner_subkey(public_key: bytes) -> bytes:
    """The DHT subkey only the owner of `public_key` may write (hivemind's RSASignatureValidator)."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", public_key)


def verified_usernames(found, state: AccessState, named: dict[bytes, str]) -> dict[bytes, str]:
    """Subkey -> username of every admitted signer of the run's records, for a monitor.

    `named` keeps every credential verified so far, expired ones too: the DHT accepted a peer's records only while
    its token was valid, and a peer that left (its credential gone from the DHT with its token) keeps its name on
    the run's records. Revoked users are left out at once.
    """
    for token in read_credentials(found).values():
        if state.refusal(token) in (None, EXPIRED):
            named[owner_subkey(token.public_key)] = token.username
    revoked = state.revocations().revoked
    return {subkey: name for subkey, name in named.items() if name not in revoked}


class RunAccess:
    """A peer's side of an authenticated run (main process): key, token, revocations, credential, counts.

    After `start(dht)`, a keeper thread does the periodic work every --auth-refresh seconds, so that nothing waits
    for the training loop (a long step must not let the token expire): renew the token from the auth server
    when half of its lifetime is left, store the credential again, fetch the revocation list, adopt the
    newest one in the DHT and relay it. The training loop only calls `tick()`, which stops a peer that is no
    longer admitted. (DHT calls from this thread are small, as those of hivemind's own averager processes.)
    """

    def __init__(self, settings: AuthSettings, run_id: str, identity_path: str | None, console: Console) -> None:
        self.settings, self.run_id, self.console = settings, run_id, console
        self.authority = load_authority_public_key(Path(settings.authority_key))
        if self.authority.run_id != run_id:
            raise AuthError(
                f"--authority-key {settings.authority_key} is the authority of run {self.authority.run_id!r}, "
                f"not of --run-id {run_id!r}"
            )
        self.identity_path = identity_path  # None: a new key for this start
        self.key = load_identity(Path(identity_path)) if identity_path is not None else new_peer_key()
        use_as_process_key(self.key)  # before hivemind's validators and authorizer read it
        self.public_key = self.key.get_public_key().to_bytes()
        self.state = AccessState(run_id, self.authority)
        self.dht = None
        self.keeper: threading.Thread | None = None
        self.stopping = threading.Event()
        self.keeper_error: str | None = None
        self.named: dict[bytes, str] = {}  # a monitor's: every subkey whose credential it has verified
        token = self.first_token()
        self.token_received_at = time.time()  # with the expiry, how long the server's tokens last
        self.state.own_token.write(as_proto(token).SerializeToString())
        self.username = token.username

    @contextmanager
    def identity_file(self) -> Iterator[str]:
        """The peer key as a file, for hivemind's p2p daemon to read when it starts: --identity, or a private
        temporary file removed afterwards."""
        if self.identity_path is not None:
            yield self.identity_path
            return
        folder = Path(tempfile.mkdtemp(prefix="ttt-identity-"))
        try:
            write_identity(folder / "identity.key", self.key)
            yield str(folder / "identity.key")
        finally:
            shutil.rmtree(folder)

    def first_token(self) -> Token:
        settings = self.settings
        if settings.token:
            token_file = read_token_file(Path(settings.token))
            check_own_token(token_file, self.authority, self.public_key, f"--token {settings.token}")
            return token_file.token
        server_run, server_key = fetch_authority_key(settings.auth_server)
        if server_key != self.authority.key.to_bytes() or server_run != self.run_id:
            raise AuthError(
                f"the auth server {settings.auth_server} signs for another authority than --authority-key "
                f"{settings.authority_key} (run {server_run!r}): get the run's current run.pub from its organiser"
            )
        self.adopt(fetch_revocations(settings.auth_server))
        token = request_token(settings.auth_server, self.run_id, self.public_key, self.login())
        check_own_token(TokenFile(self.run_id, token), self.authority, self.public_key, "the token the server sent")
        return token

    def login(self) -> Login:
        settings = self.settings
        if settings.username:
            return Login(username=settings.username, password=settings.password)
        token = hub_token(settings.hf_token)
        if token is None:
            from huggingface_hub import get_token

            token = get_token()
        if token is None:
            raise AuthError(
                "--auth-server without --username logs in with a Hugging Face account: set HF_TOKEN or run "
                "`huggingface-cli login` (or pass --username for an allowlist)"
            )
        return Login(hf_token=token)

    @property
    def authorizer(self) -> TokenAuthorizer:
        return TokenAuthorizer(self.state, self.key)

    @property
    def admitted_peers(self) -> AdmittedPeers:
        return AdmittedPeers(self.state)

    @property
    def subkey(self) -> bytes:
        return owner_subkey(self.public_key)

    def start(self, dht) -> None:
        """Publish the credential and wait until it is stored (the others answer this peer's averaging requests
        only once they can read it), then start the keeper thread."""
        self.dht = dht
        if not self.publish_credential().result():
            raise AuthError("the run's peers did not store this peer's credential: do they share --authority-key?")
        self.keeper = threading.Thread(target=self.keep, name="auth-keeper", daemon=True)
        self.keeper.start()

    def publish_credential(self):
        data = self.state.own_token.read()[1]
        expires = parse_time(AccessToken.FromString(data).expiration_time)
        return self.dht.store(credentials_key(self.run_id), data, expires, subkey=self.subkey, return_future=True)

    def keep(self) -> None:
        while not self.stopping.wait(self.settings.refresh):
            try:
                if self.settings.auth_server:
                    self.renew()
                self.publish_credential()
                self.read_dht_revocations()
            except Exception as err:  # the DHT going away on shutdown; anything else is said, and retried
                if self.stopping.is_set():
                    return
                self.console.print(f"[yellow]auth: {type(err).__name__}: {err}; trying again[/]")

    def renew(self) -> None:
        """Fetch the revocation list, and a new token once half of the current one's lifetime is left."""
        try:
            self.adopt(fetch_revocations(self.settings.auth_server))
            expires = parse_time(self.state.token().expiration_time)
            if expires - time.time() < RENEW_AT * (expires - self.token_received_at):
                token = request_token(self.settings.auth_server, self.run_id, self.public_key, self.login())
                self.state.own_token.write(as_proto(token).SerializeToString())
                self.token_received_at = time.time()
                self.console.print(f"access token renewed (valid until {token.expiration_time})")
            error = None
        except AuthError as err:
            error = str(err)
        if error is not None and error != self.keeper_error:
            self.console.print(f"[yellow]{error}; trying again every {self.settings.refresh:g} s[/]")
        self.keeper_error = error

    def read_dht_revocations(self) -> None:
        """Adopt the newest valid list in the DHT, and store the newest this peer knows there: relaying the
        server's to peers with offline tokens, and keeping it alive after the nodes that held it left."""
        try:
            found = read_latest(self.dht, revocations_key(self.run_id), return_future=True).result(
                timeout=self.settings.refresh
            )
        except Exception:  # a failed read changes nothing; the next comes in one refresh period
            found = None
        for entry in found.value.values() if found is not None and isinstance(found.value, dict) else ():
            try:
                self.adopt(RevocationList.from_bytes(entry.value))
            except (ValueError, TypeError):
                continue
        self.store_revocations()

    def store_revocations(self) -> None:
        """Store the newest list this peer knows in the DHT, under its own subkey (in the background)."""
        current = self.state.revocations()
        if current.signature:
            expiration = get_dht_time() + RELAY_LIFETIME
            self.dht.store(
                revocations_key(self.run_id), current.to_bytes(), expiration, subkey=self.subkey, return_future=True
            )

    def relay(self, revocations: RevocationList) -> None:
        """Adopt a list this process signed (a monitor's --revoke-convicted, whose revoker said whom it added) and
        store it in the DHT at once."""
        self.adopt(revocations, news=False)
        self.store_revocations()

    def adopt(self, revocations: RevocationList, news: bool = True) -> None:
        """Take `revocations` if the authority signed it and it is newer than the current list; with `news`, say
        whom it adds."""
        current = self.state.revocations()
        if revocations.verified(self.authority) and revocations.issued_at > current.issued_at:
            self.state.revocation_list.write(revocations.to_bytes())
            added = sorted(set(revocations.revoked) - set(current.revoked))
            if added and news and self.keeper is not None:  # news, not the list this peer joined with
                self.console.print(f"revoked by the run's organiser: {', '.join(added)} (no longer admitted)")

    def tick(self) -> None:
        """From the peer's loop: stop a peer that is no longer admitted."""
        self.check_own_access()

    def check_own_access(self) -> None:
        """A peer that is no longer admitted leaves with one line instead of being refused by everyone."""
        reason = self.state.refusal(self.state.token())
        if reason == REVOKED:
            raise AuthError(f"{self.username} was removed from run {self.run_id!r} by its organiser (revoked)")
        if reason == EXPIRED:
            remedy = self.keeper_error or "pass a new --token, or use --auth-server to renew it automatically"
            raise AuthError(f"this peer's access token expired at {self.state.token().expiration_time}: {remedy}")

    def refused_counts(self) -> dict[str, int]:
        return self.state.refused_counts()

    def usernames(self, found) -> dict[bytes, str]:
        """Subkey -> verified username, from a `dht.get` of the credentials key (a monitor's read)."""
        return verified_usernames(found, self.state, self.named)

    def close(self) -> None:
        self.stopping.set()
        if self.keeper is not None:
            self.keeper.join(timeout=1.0)  # it may be inside a request; a daemon thread, and it stops quietly


def start_access(settings: PeerSettings | MonitorSettings, console: Console) -> RunAccess | None:
    """An authenticated run's key, token and checks (before anything of hivemind's reads the process key)."""
    if settings.auth is None:
        return None
    access = RunAccess(settings.auth, settings.run.run_id, settings.identity_path, console)
    console.print(
        f"admitted to run {settings.run.run_id!r} as {access.username} (token valid until "
        f"{access.state.token().expiration_time})"
    )
    return access
