"""hivemind's token protocol on a peer's DHT requests, with the token of ttt's access state (training/auth/).

hivemind signs every DHT request with the process-wide key and attaches the peer's access token; the authorizer of
the receiving peer checks both. `TokenAuthorizer` runs in the DHT's process and reads the token the main process
keeps (`AccessState`, in shared memory), so a renewed token is used at once.
"""

from __future__ import annotations

from typing import Protocol

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizedRequestBase, TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey

from training.auth.tokens import OTHER_KEY


class TokenState(Protocol):
    """What the authorizer reads of a peer's access (training/auth/guard.py's `AccessState`)."""

    own_token: object  # SharedBytes: (version, the token's protobuf bytes); `.version.value` is the version

    def refusal(self, token: AccessToken) -> str | None: ...

    def count(self, request: str, caller: str, reason: str) -> None: ...


class TokenAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol for the DHT (in the DHT's process), with the token the main process keeps."""

    def __init__(self, state: TokenState, local_private_key: RSAPrivateKey) -> None:
        super().__init__(local_private_key)
        self.state = state
        self.token_version = -1

    async def get_token(self) -> AccessToken:
        self.token_version, data = self.state.own_token.read()
        return AccessToken.FromString(data)

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return self.state.refusal(access_token) is None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return self.state.own_token.version.value != self.token_version

    async def refresh_token_if_needed(self) -> None:
        # hivemind asserts that its own token is valid; a revoked or expired peer is stopped by its main process
        # (RunAccess.tick) with a message instead, and meanwhile the others refuse its requests.
        if self._local_access_token is None or self.does_token_need_refreshing(self._local_access_token):
            self._local_access_token = await self.get_token()

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        token = request.auth.client_access_token
        reason = self.state.refusal(token)
        if reason is None and not await super().validate_request(request):
            reason = OTHER_KEY  # the request is not signed by the token's key (or is replayed)
        if reason is not None:
            self.state.count("dht", token.username or "a peer without a token", reason)
        return reason is None


def wrap_private_key(key) -> RSAPrivateKey:
    """A `cryptography` RSA private key as hivemind's wrapper, built as its own unpickling builds one."""
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped._private_key = key
    return wrapped


def use_as_process_key(key: RSAPrivateKey) -> None:
    """Make `key` hivemind's process-wide key: it then signs this peer's DHT requests and records, as the token
    bound to it requires. Call before anything of hivemind's reads the process-wide key."""
    RSAPrivateKey._process_wide_key = key
