"""The dashboard's web server: the page, its local assets, the previews, and the machine interfaces.

    /                  the dashboard (training/monitor/static/index.html)
    /join              how to join this run, with the live addresses and the memory calculator
    /static/...        the pages' scripts, styles and the vendored chart library: nothing comes from a CDN
    /previews/NAME     images the monitor drew from its checkpoints
    /api/state         JSON of everything the page shows
    /api/calc?OPTIONS  the memory calculator: `ttt calc --json`'s document for the same options
                       (training/calc/command.py's CALC_OPTIONS, e.g. ?preset=small&batch_size=16&offload=1&fit_gib=8),
                       or HTTP 400 with {"error": "..."} saying what is wrong with them
    /api/calc/choices  the calculator's models and choices, and the setup `ttt train` runs, for the Join page's form
    /metrics           the same figures in Prometheus' text format, for organisers who run Grafana

The refresh loop builds the JSON and the Prometheus text once per refresh (`publish`); requests only send
those bytes, so a page open in a thousand browsers costs the monitor nothing more than one. The calculator
is pure arithmetic (training/calc/memory.py) and answers in milliseconds.
"""

from __future__ import annotations

import json
import mimetypes
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

from training.calc.command import calculate, parse_query
from training.calc.memory import MODELS, OPTIMIZERS, PRECISIONS, CalcError, train_setup
from training.config import PRESETS, PeerSettings, RunSettings

STATIC = Path(__file__).parent / "static"
PAGES = {"/": "index.html", "/join": "join.html"}

# What the Join page's calculator offers, starting from the setup `ttt train` runs (training/calc/memory.py's
# train_setup) with the default --batch-size and --audit-rate; reversible layers where the preset's model has them.
TRAIN_DEFAULTS = train_setup(
    PRESETS[RunSettings.preset].model, PeerSettings.batch_size, audit_rate=PeerSettings.audit_rate
)
CALC_CHOICES = json.dumps(
    {
        "models": list(MODELS),
        "optimizers": list(OPTIMIZERS),
        "precisions": list(PRECISIONS),
        "reversible": [name for name, preset in PRESETS.items() if preset.model.reversible],
        "defaults": {
            "preset": RunSettings.preset,
            **{
                name: getattr(TRAIN_DEFAULTS, name)
                for name in (
                    "batch_size",
                    "optimizer",
                    "precision",
                    "offload",
                    "checkpointing",
                    "audits",
                    "uplink_mbit",
                )
            },
        },
    }
).encode()


class Published:
    """The latest state, as the bytes each interface sends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state_json = b"{}"
        self.metrics_text = b""

    def publish(self, state_json: bytes, metrics_text: bytes) -> None:
        with self.lock:
            self.state_json, self.metrics_text = state_json, metrics_text


def file_under(folder: Path, name: str) -> Path | None:
    """FOLDER/NAME if it is a file inside FOLDER (no way out with ..), else None."""
    path = (folder / name).resolve()
    return path if path.is_file() and path.is_relative_to(folder.resolve()) else None


def calc_answer(query: str) -> tuple[HTTPStatus, bytes]:
    """/api/calc's answer to a query string: the estimate as `ttt calc --json` prints it, or why there is none."""
    try:
        # Blank values are kept so that an emptied field is an error rather than silently the default.
        result = calculate(parse_query(parse_qs(query, keep_blank_values=True)))
        return HTTPStatus.OK, json.dumps(result.to_dict(), allow_nan=False).encode()
    except CalcError as error:
        return HTTPStatus.BAD_REQUEST, json.dumps({"error": str(error)}).encode()


def make_handler(published: Published, previews: Path, wheels: Path | None) -> type[BaseHTTPRequestHandler]:
    class DashboardHandler(BaseHTTPRequestHandler):
        server_version = "ttt-monitor"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            route = self.path.split("?", 1)[0]
            if route in PAGES:
                self.send_file(STATIC / PAGES[route])
            elif route == "/api/state":
                with published.lock:
                    self.send(published.state_json, "application/json")
            elif route == "/api/calc":
                status, body = calc_answer(self.path.partition("?")[2])
                self.send(body, "application/json", status)
            elif route == "/api/calc/choices":
                self.send(CALC_CHOICES, "application/json")
            elif route == "/metrics":
                with published.lock:
                    self.send(published.metrics_text, "text/plain; version=0.0.4; charset=utf-8")
            elif route.startswith("/static/"):
                self.send_file(file_under(STATIC, route.removeprefix("/static/")))
            elif route.startswith("/previews/"):
                self.send_file(file_under(previews, route.removeprefix("/previews/")))
            elif route.startswith("/wheel/") and wheels is not None:
                self.send_file(file_under(wheels, route.removeprefix("/wheel/")))
            else:
                self.send_error(HTTPStatus.NOT_FOUND)

        def send_file(self, path: Path | None) -> None:
            if path is None or not path.is_file():
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            if content_type.startswith("text/") or content_type.endswith("javascript"):
                content_type += "; charset=utf-8"
            self.send(path.read_bytes(), content_type)

        def send(self, body: bytes, content_type: str, status: HTTPStatus = HTTPStatus.OK) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
            pass  # the monitor's console is for the run, not for every page view

    return DashboardHandler


def serve(
    host: str, port: int, published: Published, previews: Path, wheels: Path | None = None
) -> ThreadingHTTPServer:
    """Start serving in a background thread (the files of `previews` and `wheels` too); OSError when the address
    cannot be bound."""
    server = ThreadingHTTPServer((host, port), make_handler(published, previews, wheels))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="dashboard", daemon=True).start()
    return server
