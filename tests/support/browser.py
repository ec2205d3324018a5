"""Drive a real browser for the monitor's tests and bench: Debian's Chromium through Playwright, headless and offline.

Playwright's own browser downloads are not used (`playwright install` is never needed): the tests launch the
system's Chromium by path. Each call opens a fresh browser, loads one page, waits until it has rendered, and returns
what a test asserts on: the visible text, the number of chart canvases, and every console error, uncaught page
error, failed request and request that left the page's origin. `browser_page` hands a test the Playwright page
itself, with the same record of what went wrong, to click and type on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict
from urllib.parse import urlsplit

from playwright.sync_api import ConsoleMessage, Page, Request, Response, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

CHROMIUM = "/usr/bin/chromium"
# Without these Chromium keeps dialling Google's services on a machine without Internet and stalls on the refusals.
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
DESKTOP = (1280, 900)
PHONE = (390, 844)
# The Join page has rendered a state and its calculator has answered (with an estimate or an error).
JOIN_RENDERED = 'body[data-renders] #calc:is([data-state="ok"], [data-state="error"])'


class PageReport(TypedDict):
    """What a loaded page showed and what went wrong while it loaded."""

    url: str
    title: str
    text: str  # document.body.innerText
    canvases: int  # <canvas> elements inside #charts (one per uPlot chart; 0 on the Join page)
    console_errors: list[str]  # console messages of type "error"
    page_errors: list[str]  # uncaught exceptions in the page's scripts
    failed_requests: list[str]  # "GET <url>: <failure>" for network failures, "GET <url> -> <status>" for 4xx/5xx
    offsite_requests: list[str]  # requests to anything but the page's own origin (the pages must work offline)
    errors: list[str]  # all of the four above together: a page that loaded cleanly has none


@dataclass
class Problems:
    """What went wrong on an open page so far; the lists grow while it stays open."""

    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    offsite_requests: list[str] = field(default_factory=list)

    def all(self) -> list[str]:
        return self.console_errors + self.page_errors + self.failed_requests + self.offsite_requests


def require_chromium() -> str:
    """The Chromium executable, or a clear error saying how to install it."""
    if not Path(CHROMIUM).is_file():
        raise RuntimeError(
            f"Chromium is not installed at {CHROMIUM}: the browser tests drive Debian's Chromium through Playwright "
            "(Playwright's own browser download is not used). Install it with `apt-get install chromium`."
        )
    return CHROMIUM


@contextmanager
def browser_page(
    url: str, timeout_s: float = 60, viewport: tuple[int, int] = DESKTOP
) -> Iterator[tuple[Page, Problems]]:
    """`url` loaded in a fresh headless Chromium, and the record of what goes wrong on it while it is open; every
    wait on the page times out after `timeout_s`. The browser closes when the block ends."""
    executable = require_chromium()
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(url))
    problems = Problems()

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            location = message.location
            where = f" ({location['url']}:{location['lineNumber']})" if location and location.get("url") else ""
            problems.console_errors.append(message.text + where)

    def on_request(request: Request) -> None:
        if not request.url.startswith((origin + "/", "data:", "blob:", "about:")):
            problems.offsite_requests.append(request.url)

    def on_request_failed(request: Request) -> None:
        problems.failed_requests.append(f"{request.method} {request.url}: {request.failure}")

    def on_response(response: Response) -> None:
        if response.status >= 400:
            problems.failed_requests.append(f"{response.request.method} {response.url} -> {response.status}")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=list(CHROMIUM_ARGS))
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.set_default_timeout(timeout_s * 1000)
            page.on("console", on_console)
            page.on("pageerror", lambda error: problems.page_errors.append(str(error)))
            page.on("request", on_request)
            page.on("requestfailed", on_request_failed)
            page.on("response", on_response)
            page.goto(url, wait_until="load")
            yield page, problems
        finally:
            browser.close()


def wait_until_attached(page: Page, selector: str, problems: Problems) -> None:
    """Wait until `selector` (CSS) is attached to the page; if it never is, an error with what the page shows."""
    try:
        page.wait_for_selector(selector, state="attached")
    except PlaywrightTimeoutError:
        text = page.evaluate("document.body ? document.body.innerText : ''")
        raise RuntimeError(
            f"{page.url}: {selector!r} did not appear; errors: {problems.all()}; the page shows:\n{text}"
        ) from None


def open_page(
    url: str,
    wait_for: str,
    screenshot: Path | None = None,
    timeout_s: float = 60,
    viewport: tuple[int, int] = DESKTOP,
) -> PageReport:
    """Open `url` in headless Chromium, wait until `wait_for` (a CSS selector) is attached and the page's images have
    loaded, save a full-page PNG to `screenshot` (when given) and report on the page."""
    with browser_page(url, timeout_s, viewport) as (page, problems):
        wait_until_attached(page, wait_for, problems)
        page.wait_for_function("Array.from(document.images).every((image) => image.complete)")
        page.evaluate("() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        title = page.title()
        text = page.evaluate("document.body.innerText")
        canvases = page.evaluate("document.querySelectorAll('#charts canvas').length")
    return PageReport(
        url=url,
        title=title,
        text=text,
        canvases=canvases,
        console_errors=problems.console_errors,
        page_errors=problems.page_errors,
        failed_requests=problems.failed_requests,
        offsite_requests=problems.offsite_requests,
        errors=problems.all(),
    )


def open_dashboard(
    url: str,
    screenshot: Path,
    wait_for: str = "#charts canvas",
    timeout_s: float = 60,
    viewport: tuple[int, int] = DESKTOP,
) -> PageReport:
    """The dashboard at `url` (the monitor's `/`), once its charts are drawn from a first /api/state."""
    return open_page(url, wait_for, screenshot, timeout_s, viewport)


def open_join(
    url: str,
    screenshot: Path | None = None,
    timeout_s: float = 60,
    viewport: tuple[int, int] = DESKTOP,
) -> PageReport:
    """The Join page at `url` (the monitor's `/join`), once its commands are filled in from /api/state and its
    calculator has answered."""
    return open_page(url, JOIN_RENDERED, screenshot, timeout_s, viewport)
