"""`ttt auth serve`: the run's auth server. It checks a volunteer and signs an access token for their peer key.

    POST /api/token        {"run_id", "public_key", "username", "password"}  (allowlist mode)
                           {"run_id", "public_key", "hf_token"}               (--hf-org mode)
                           -> 200 {"token": {...}} | 4xx {"error": one line, "reason": a short code}
    GET  /api/revocations  the signed revocation list (peers relay it through the run's DHT)
    GET  /api/authority    {"run_id", "public_key"}: lets a peer check its --authority-key

The allowlist and the revocation list are read again whenever their files change, so `ttt auth add-user` and
`ttt auth revoke` take effect without a restart. The log names the method, path, status and username, never a
password or a token. With --hf-org, the server asks the Hub (HF_ENDPOINT) who a read token belongs to and
whether they are in the organisation, as the paper's server did.
"""

from __future__ import annotations

import json
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from training.auth.keys import AuthError, Authority, PublicKey
from training.auth.tokens import (
    REVOCATIONS,
    RevocationList,
    TokenFile,
    issue_token,
    read_revocations,
)
from training.auth.users import USERNAME, password_matches, read_allowlist
from training.config import AuthServerSettings

MAX_BODY = 16 * 1024


class Refused(Exception):
    """A request the server turns down: the HTTP status, a short reason code and one line for the volunteer."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


class ChangingFile:
    """A file read again only when it changes (its mtime and size)."""

    def __init__(self, path: Path, read) -> None:
        self.path, self.read, self.lock = path, read, threading.Lock()
        self.seen, self.value = None, None

    def get(self):
        with self.lock:
            stat = self.path.stat() if self.path.exists() else None
            signature = (stat.st_mtime_ns, stat.st_size) if stat else None
            if self.value is None or signature != self.seen:
                self.value, self.seen = self.read(), signature
            return self.value


class AuthService:
    """What the server decides; the HTTP handler only translates."""

    def __init__(self, authority: Authority, settings: AuthServerSettings) -> None:
        self.authority, self.settings = authority, settings
        self.revocations = ChangingFile(authority.folder / REVOCATIONS, lambda: read_revocations(authority))
        self.allowlist = None
        if settings.allowlist:
            path = Path(settings.allowlist)
            self.allowlist = ChangingFile(path, lambda: read_allowlist(path))

    def issue(self, request: dict) -> tuple[str, TokenFile]:
        """The username and a token for a well-formed, admitted request; Refused otherwise."""
        run_id, public_key = request.get("run_id"), request.get("public_key")
        if not isinstance(run_id, str) or not isinstance(public_key, str):
            raise Refused(400, "malformed", "the request needs run_id and public_key (strings)")
        if run_id != self.authority.run_id:
            raise Refused(
                409, "wrong_run", f"this server admits peers of run {self.authority.run_id!r}, not {run_id!r}"
            )
        try:
            PublicKey.from_bytes(public_key.encode())
        except ValueError:
            raise Refused(400, "malformed", "public_key is not an RSA public key (OpenSSH format)") from None
        username = self.check_hub_account(request) if self.settings.hf_org else self.check_password(request)
        revoked: RevocationList = self.revocations.get()
        if username in revoked.revoked:
            raise Refused(403, "revoked", f"{username} was removed from run {run_id!r} by its organiser")
        token = issue_token(self.authority, username, public_key.encode(), self.settings.token_lifetime)
        return username, TokenFile(run_id, token)

    def check_password(self, request: dict) -> str:
        username, password = request.get("username"), request.get("password")
        if not isinstance(username, str) or not isinstance(password, str):
            raise Refused(400, "malformed", "this server admits users of its allowlist: send username and password")
        if not USERNAME.fullmatch(username):
            raise Refused(400, "malformed", f"{username!r} is not a valid username")
        stored = self.allowlist.get().get(username)
        if stored is None:
            raise Refused(403, "not_allowed", f"{username} is not on this run's allowlist: ask the organiser")
        if not password_matches(password, stored):
            raise Refused(401, "wrong_password", f"wrong password for {username}")
        return username

    def check_hub_account(self, request: dict) -> str:
        hf_token = request.get("hf_token")
        org = self.settings.hf_org
        if not isinstance(hf_token, str) or not hf_token:
            raise Refused(
                400, "malformed", f"this server admits Hugging Face accounts of {org}: send hf_token (a read token)"
            )
        from huggingface_hub import whoami
        from huggingface_hub.utils import HfHubHTTPError

        try:
            account = whoami(token=hf_token)
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            if status == 401:
                raise Refused(401, "bad_hf_token", "the Hugging Face Hub refused this token: log in again") from None
            raise Refused(502, "hub_unavailable", f"cannot ask the Hugging Face Hub ({status}); try later") from None
        except OSError as err:  # requests' connection errors are OSErrors
            raise Refused(502, "hub_unavailable", f"cannot reach the Hugging Face Hub ({type(err).__name__})") from None
        username = str(account.get("name", ""))
        orgs = {str(entry.get("name")) for entry in account.get("orgs", []) if isinstance(entry, dict)}
        if org not in orgs:
            raise Refused(403, "not_in_org", f"{username} is not a member of {org} on the Hugging Face Hub")
        if not USERNAME.fullmatch(username):
            raise Refused(403, "not_allowed", f"{username!r} cannot be a ttt username")
        return username


class AuthHandler(BaseHTTPRequestHandler):
    """The HTTP side of an AuthService (`service`, bound by `make_handler`): routes the three endpoints, reads the
    request's JSON, answers in JSON, and logs each request without what it carried."""

    service: AuthService
    server_version = "ttt-auth"
    username = "-"  # for the log line of this request

    def do_GET(self) -> None:
        if self.path == "/api/revocations":
            self.send(200, self.service.revocations.get().to_bytes())
        elif self.path == "/api/authority":
            public = self.service.authority.public
            self.send_json(200, {"run_id": public.run_id, "public_key": public.key.to_bytes().decode()})
        else:
            self.send_json(404, {"error": f"no such endpoint: GET {self.path}", "reason": "not_found"})

    def do_POST(self) -> None:
        if self.path != "/api/token":
            self.send_json(404, {"error": f"no such endpoint: POST {self.path}", "reason": "not_found"})
            return
        try:
            username, token_file = self.service.issue(self.read_json())
        except Refused as refused:
            self.send_json(refused.status, {"error": str(refused), "reason": refused.reason})
            return
        self.username = username
        self.send(200, json.dumps({"token": json.loads(token_file.to_json())}).encode())

    def read_json(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise Refused(411, "malformed", "the request needs a Content-Length") from None
        if length > MAX_BODY:
            raise Refused(413, "malformed", f"the request is larger than {MAX_BODY} bytes")
        try:
            body = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise Refused(400, "malformed", "the request is not JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "malformed", "the request is not a JSON object")
        return body

    def send_json(self, status: int, body: dict) -> None:
        self.send(status, json.dumps(body).encode())

    def send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        # The request line only (never a body: that is where passwords and tokens are) and who got a token.
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{stamp} {self.address_string()} {self.command} {self.path} {code} user={self.username}", flush=True)

    def log_message(self, format: str, *args) -> None:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.address_string()} {format % args}", file=sys.stderr)


def make_handler(service: AuthService) -> type[BaseHTTPRequestHandler]:
    """The handler class of a server of `service`: AuthHandler bound to it."""
    return type("Handler", (AuthHandler,), {"service": service})


def start_server(service: AuthService, settings: AuthServerSettings) -> ThreadingHTTPServer:
    try:
        server = ThreadingHTTPServer((settings.host, settings.port), make_handler(service))
    except OSError as err:
        raise AuthError(
            f"cannot serve on {settings.host}:{settings.port} ({err.strerror}); pass a free --port"
        ) from None
    if settings.certfile:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(settings.certfile, settings.keyfile)
        except (OSError, ssl.SSLError) as err:
            server.server_close()
            raise AuthError(f"cannot use --certfile/--keyfile for HTTPS ({err})") from None
        server.socket = context.wrap_socket(server.socket, server_side=True)
    return server
