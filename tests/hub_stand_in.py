"""A local stand-in for the parts of the Hugging Face Hub's HTTP API the tests reach (selected with HF_ENDPOINT).

Strict: it answers only the requests it knows, as the Hub answers them, and fails loudly on anything else, so a
test shows what is missing. Today:
    GET /api/whoami-v2        who a token belongs to, and their organisations (the auth server's --hf-org check)
    GET /api/agent-harnesses  the registry huggingface_hub reads (once a day) to name the client in its user agent;
                              an empty one
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubStandIn:
    """`accounts`: token -> (username, organisations). Use as a context manager; `endpoint` is its URL."""

    def __init__(self, accounts: dict[str, tuple[str, list[str]]]) -> None:
        self.accounts = accounts
        self.unknown: list[str] = []  # requests it does not implement
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/api/agent-harnesses":
                    self.answer(200, {"standardEnvVars": [], "harnesses": {}})
                    return
                if self.path != "/api/whoami-v2":
                    hub.unknown.append(f"GET {self.path}")
                    self.answer(501, {"error": f"the stand-in does not implement GET {self.path}"})
                    return
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                if token not in hub.accounts:
                    self.answer(401, {"error": "Invalid credentials in Authorization header"})
                    return
                name, orgs = hub.accounts[token]
                self.answer(200, {"type": "user", "name": name, "orgs": [{"type": "org", "name": o} for o in orgs]})

            def answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args) -> None:
                pass

        return Handler

    def __enter__(self) -> HubStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        assert not self.unknown, f"requests the stand-in does not implement: {self.unknown}"
