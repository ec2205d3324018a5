"""Drive a real browser for the monitor's tests and bench: Debian's Chromium through Playwright, headless and offline.

Playwright's own browser downloads are not used (`playwright install` is never needed): the tests launch the
system's Chromium by path. Each call opens a fresh browser, loads one page, waits until it has rendered, and returns
what a test asserts on: the visible text, the number of chart canvases, and every console error, uncaught page
error, failed request and request that left the page's origin.
"""

from __future__ import annotations

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


def require_chromium() -> str:
    """The Chromium executable, or a clear error saying how to install it."""
    if not Path(CHROMIUM).is_file():
        raise RuntimeError(
            f"Chromium is not installed at {CHROMIUM}: the browser tests drive Debian's Chromium through Playwright "
            "(Playwright's own browser download is not used). Install it with `apt-get install chromium`."
        )
    return CHROMIUM


def open_page(
    url: str,
    wait_for: str,
    screenshot: Path | None = None,
    timeout_s: float = 60,
    viewport: tuple[int, int] = DESKTOP,
) -> PageReport:
    """Open `url` in headless Chromium, wait until `wait_for` (a CSS selector) is attached and the page's images have
    loaded, save a full-page PNG to `screenshot` (when given) and report on the page."""
    executable = require_chromium()
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(url))
    console_errors: list[str] = []
    page_errors: list[str] = []
    failed: list[str] = []
    offsite: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            location = message.location
            where = f" ({location['url']}:{location['lineNumber']})" if location and location.get("url") else ""
            console_errors.append(message.text + where)

    def on_request(request: Request) -> None:
        if not request.url.startswith((origin + "/", "data:", "blob:", "about:")):
            offsite.append(request.url)

    def on_request_failed(request: Request) -> None:
        failed.append(f"{request.method} {request.url}: {request.failure}")

    def on_response(response: Response) -> None:
        if response.status >= 400:
            failed.append(f"{response.request.method} {response.url} -> {response.status}")

    timeout_ms = timeout_s * 1000
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=list(CHROMIUM_ARGS))
        try:
            page: Page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.on("console", on_console)
            page.on("pageerror", lambda error: page_errors.append(str(error)))
            page.on("request", on_request)
            page.on("requestfailed", on_request_failed)
            page.on("response", on_response)
            page.goto(url, wait_until="load", timeout=timeout_ms)
            try:
                page.wait_for_selector(wait_for, state="attached", timeout=timeout_ms)
            except PlaywrightTimeoutError:
                text = page.evaluate("document.body ? document.body.innerText : ''")
                problems = console_errors + page_errors + failed + offsite
                raise RuntimeError(
                    f"{url}: {wait_for!r} did not appear within {timeout_s:g} s; "
                    f"errors: {problems}; the page shows:\n{text}"
                ) from None
            page.wait_for_function("Array.from(document.images).every((image) => image.complete)", timeout=timeout_ms)
            page.evaluate("() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
            if screenshot is not None:
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True, timeout=timeout_ms)
            title = page.title()
            text = page.evaluate("document.body.innerText")
            canvases = page.evaluate("document.querySelectorAll('#charts canvas').length")
        finally:
            browser.close()
    return PageReport(
        url=url,
        title=title,
        text=text,
        canvases=canvases,
        console_errors=console_errors,
        page_errors=page_errors,
        failed_requests=failed,
        offsite_requests=offsite,
        errors=console_errors + page_errors + failed + offsite,
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
    """The Join page at `url` (the monitor's `/join`), once its commands are filled in from /api/state."""
    return open_page(url, "body[data-renders]", screenshot, timeout_s, viewport)
