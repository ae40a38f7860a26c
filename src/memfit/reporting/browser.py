"""Open a report in headless Chromium, as a person would, and say what the page did.

`check_page(path)` loads the file in a fresh Chromium profile, blocks and records every
request that is not for a local file, collects console errors and uncaught exceptions,
counts the series each plotly chart drew, and takes a screenshot of the whole page.
It talks the Chrome DevTools protocol over a pipe (`--remote-debugging-pipe`: JSON
messages ended by a NUL byte on file descriptors 3 and 4), so it needs nothing but a
Chromium binary. The tests and benchmarks/make_report_screenshot.py use it.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# No first-run pages, no update or sync traffic, no GPU: the page alone decides what is fetched.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--mute-audio",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
)

# Per chart: the series plotly was given and the series groups it drew with a non-empty SVG path.
_CHARTS_SCRIPT = """
(() => Array.from(document.querySelectorAll('.plotly-graph-div')).map(gd => {
  // The range slider under a chart draws its series a second time: count the main plot only.
  const drawn = Array.from(gd.querySelectorAll('g.trace')).filter(group => !group.closest('.rangeslider-container') &&
    Array.from(group.querySelectorAll('path')).some(path => {
      const d = path.getAttribute('d');
      return d && d.length > 4 && d !== 'M0,0Z';
    }));
  return {id: gd.id, series: (gd.data || []).length, drawn: drawn.length,
          ready: Boolean(gd._fullLayout), names: (gd.data || []).map(trace => trace.name || '')};
}))()
"""


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) binary on PATH, or None."""
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageCheck:
    """What a page did when it loaded.

    Attributes:
        console_errors: console.error/assert calls, uncaught exceptions and browser log errors.
        blocked_requests: URLs the page asked for that are not local (they were refused).
        requests: every URL requested while loading.
        charts: per plotly chart: id, series given, series drawn, ready, trace names.
        screenshot: the whole page as PNG bytes.
    """

    console_errors: list[str] = field(default_factory=list)
    blocked_requests: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    charts: list[dict[str, Any]] = field(default_factory=list)
    screenshot: bytes = b""


class _DevTools:
    """A Chrome DevTools protocol connection over the browser's pipe."""

    def __init__(self, process: subprocess.Popen, write_fd: int, read_fd: int):
        self.process, self.write_fd, self.read_fd = process, write_fd, read_fd
        self.next_id = 0
        self.buffer = b""
        self.events: list[dict[str, Any]] = []
        self.on_event = None

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("Chromium did not answer in time")
            ready, _, _ = select.select([self.read_fd], [], [], remaining)
            if ready:
                chunk = os.read(self.read_fd, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed the DevTools pipe")
                self.buffer += chunk
        message, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(message)

    def post(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        return self.next_id

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        wanted = self.post(method, params, session)
        deadline = time.monotonic() + timeout
        while True:
            message = self._read_message(deadline)
            if message.get("id") == wanted:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self._dispatch(message)

    def wait_for(self, method: str, timeout: float = 60) -> dict:
        for index, event in enumerate(self.events):
            if event["method"] == method:
                return self.events.pop(index)
        deadline = time.monotonic() + timeout
        while True:
            message = self._read_message(deadline)
            if "method" in message:
                self._dispatch(message)
                if message["method"] == method:
                    self.events.remove(message)
                    return message

    def _dispatch(self, message: dict[str, Any]) -> None:
        self.events.append(message)
        if self.on_event is not None:
            self.on_event(message)


def check_page(
    path: str | Path,
    executable: str | None = None,
    width: int = 1280,
    height: int = 900,
    timeout: float = 90,
    max_screenshot_height: int = 12000,
) -> PageCheck:
    """Load `path` in headless Chromium; return what it did (see `PageCheck`).

    Raises:
        FileNotFoundError: no Chromium binary was found.
        TimeoutError: the page did not load, or the charts did not draw, within `timeout` seconds.
    """
    executable = executable or find_chromium()
    if executable is None:
        raise FileNotFoundError("no Chromium binary on PATH (apt-get install chromium)")
    url = Path(path).resolve().as_uri()
    profile = tempfile.mkdtemp(prefix="memfit-chromium-")
    to_browser = os.pipe()
    from_browser = os.pipe()

    def wire_pipes() -> None:  # in the child: the protocol reads fd 3 and writes fd 4
        # Move both ends above 4 first: the pipes may themselves be fds 3 to 6.
        reading = fcntl.fcntl(to_browser[0], fcntl.F_DUPFD, 10)
        writing = fcntl.fcntl(from_browser[1], fcntl.F_DUPFD, 10)
        os.dup2(reading, 3, inheritable=True)
        os.dup2(writing, 4, inheritable=True)

    process = subprocess.Popen(
        [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # close_fds stays off: the fds dup2'ed to 3 and 4 in the child must survive exec (the rest are close-on-exec).
        preexec_fn=wire_pipes,
        close_fds=False,
    )
    os.close(to_browser[0])
    os.close(from_browser[1])
    tools = _DevTools(process, to_browser[1], from_browser[0])
    result = PageCheck()
    try:
        target = tools.call("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
        session = tools.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

        def on_event(message: dict[str, Any]) -> None:
            method, params = message["method"], message.get("params", {})
            if method == "Fetch.requestPaused":  # only non-local URLs are paused (see the patterns below)
                result.blocked_requests.append(params["request"]["url"])
                tools.post(
                    "Fetch.failRequest", {"requestId": params["requestId"], "errorReason": "BlockedByClient"}, session
                )
            elif method == "Network.requestWillBeSent":
                result.requests.append(params["request"]["url"])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                result.console_errors.append(
                    " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
                )
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                result.console_errors.append(
                    details.get("exception", {}).get("description") or details.get("text", "exception")
                )
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                result.console_errors.append(
                    f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip()
                )

        tools.on_event = on_event
        for domain in ("Runtime", "Log", "Page", "Network"):
            tools.call(f"{domain}.enable", {}, session)
        patterns = [
            {"urlPattern": "http://*"},
            {"urlPattern": "https://*"},
            {"urlPattern": "ws*://*"},
            {"urlPattern": "ftp://*"},
        ]
        tools.call("Fetch.enable", {"patterns": patterns}, session)
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        tools.call("Emulation.setDeviceMetricsOverride", metrics, session)
        tools.call("Page.navigate", {"url": url}, session, timeout=timeout)
        tools.wait_for("Page.loadEventFired", timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            charts = tools.call("Runtime.evaluate", {"expression": _CHARTS_SCRIPT, "returnByValue": True}, session)
            result.charts = charts.get("result", {}).get("value") or []
            if all(chart["ready"] and chart["drawn"] >= chart["series"] for chart in result.charts):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the charts did not finish drawing: {result.charts}")
            time.sleep(0.2)
        layout = tools.call("Page.getLayoutMetrics", {}, session)
        content = layout.get("cssContentSize") or layout.get("contentSize") or {}
        full_height = min(int(content.get("height", height)), max_screenshot_height)
        tools.call("Emulation.setDeviceMetricsOverride", {**metrics, "height": max(full_height, height)}, session)
        time.sleep(0.5)  # let plotly's responsive layout settle after the resize
        shown = max(full_height, height)
        clip = {"x": 0, "y": 0, "width": width, "height": shown, "scale": 1}  # the top of a longer page
        shot = tools.call(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True, "clip": clip},
            session,
            timeout=timeout,
        )
        result.screenshot = base64.b64decode(shot["data"])
        try:
            tools.call("Browser.close", {}, timeout=10)
        except (RuntimeError, TimeoutError):
            pass
    finally:
        for fd in (to_browser[1], from_browser[0]):
            os.close(fd)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(profile, ignore_errors=True)
    return result


# A tag that loads something by URL (script, stylesheet, image, frame, media) or a CSS import/url() pointing off the machine.
_REMOTE_TAG = re.compile(
    r"<(?:script|link|img|iframe|frame|source|video|audio|embed|object)\b[^>]*?\b(?:src|href|data)\s*=\s*[\"']?\s*(?:https?:)?//",
    re.IGNORECASE,
)
_REMOTE_CSS = re.compile(r"(?:@import\s+|url\(\s*)[\"']?\s*(?:https?:)?//", re.IGNORECASE)


def remote_references(page: str) -> list[str]:
    """The places where an HTML page would load something from the network (tags and CSS), empty when none.

    URLs inside inline scripts' strings (plotly's bundle names a few) are not loads and are not reported.
    """
    found = [match.group(0) for match in _REMOTE_TAG.finditer(page)]
    for style in re.findall(r"<style\b[^>]*>(.*?)</style>", page, flags=re.IGNORECASE | re.DOTALL):
        found += [match.group(0) for match in _REMOTE_CSS.finditer(style)]
    return found
