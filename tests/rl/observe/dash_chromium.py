"""Open a local HTML file in headless Chromium and report console errors, the live DOM, and a JS probe's value.

Preferred path: the Chrome DevTools Protocol over a websocket (`websockets` package), which reports console
messages with their level, uncaught exceptions and failed resource loads, and lets the test evaluate
JavaScript against the laid-out page. Fallback when `websockets` is not installed: `--dump-dom` with
`--enable-logging=stderr`, where every console line counts as an error (the report logs nothing) and no
probe runs. Chromium comes from Debian's `chromium` package; `find_chromium()` is None without it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
          "--disable-extensions", "--disable-background-networking", "--window-size=1300,2000")


def find_chromium() -> str | None:
    for b in _BROWSERS:
        p = shutil.which(b)
        if p:
            return p
    return None


@dataclass(frozen=True)
class PageResult:
    console_errors: tuple[str, ...]
    dom: str
    probe: Any  # value of the JS probe expression (None in fallback mode)
    mode: str  # "cdp" | "dump-dom"


def _cdp(browser: str, url: str, probe: str, timeout_s: float) -> PageResult:
    from websockets.sync.client import connect

    ud = tempfile.mkdtemp(prefix="jointrl-chromium-")
    proc = subprocess.Popen([browser, *_FLAGS, "--remote-debugging-port=0", f"--user-data-dir={ud}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = Path(ud) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited with code {proc.returncode} before opening its debugging port")
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not open its debugging port")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            targets = json.loads(r.read())
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
        errors: list[str] = []
        events: list[dict] = []
        with connect(ws_url, max_size=None, open_timeout=10) as ws:
            next_id = [0]

            def on_event(msg: dict) -> None:
                m, p = msg.get("method"), msg.get("params", {})
                events.append(msg)
                if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                    errors.append("console." + p["type"] + ": " + " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
                elif m == "Runtime.exceptionThrown":
                    d = p.get("exceptionDetails", {})
                    errors.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
                elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                    errors.append("log: " + str(p["entry"].get("text")) + " " + str(p["entry"].get("url", "")))

            def call(method: str, params: dict | None = None) -> dict:
                next_id[0] += 1
                ws.send(json.dumps({"id": next_id[0], "method": method, "params": params or {}}))
                while True:
                    msg = json.loads(ws.recv(timeout=max(1.0, deadline - time.monotonic())))
                    if msg.get("id") == next_id[0]:
                        if "error" in msg:
                            raise RuntimeError(f"CDP {method} failed: {msg['error']}")
                        return msg.get("result", {})
                    on_event(msg)

            for m in ("Runtime.enable", "Log.enable", "Page.enable"):
                call(m)
            call("Page.navigate", {"url": url})
            while not any(e.get("method") == "Page.loadEventFired" for e in events):
                on_event(json.loads(ws.recv(timeout=max(1.0, deadline - time.monotonic()))))
            # let late console messages / timers arrive
            settle = time.monotonic() + 0.3
            while time.monotonic() < settle:
                try:
                    on_event(json.loads(ws.recv(timeout=0.1)))
                except TimeoutError:
                    pass
            res = call("Runtime.evaluate", {"expression": probe, "returnByValue": True})
            if "exceptionDetails" in res:
                raise RuntimeError(f"probe raised: {res['exceptionDetails']}")
            dom = call("Runtime.evaluate", {"expression": "document.documentElement.outerHTML", "returnByValue": True})
        return PageResult(tuple(errors), dom["result"]["value"], res["result"].get("value"), "cdp")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(ud, ignore_errors=True)


def _dump_dom(browser: str, url: str, timeout_s: float) -> PageResult:
    ud = tempfile.mkdtemp(prefix="jointrl-chromium-")
    try:
        p = subprocess.run([browser, *_FLAGS, "--enable-logging=stderr", "--v=0", f"--user-data-dir={ud}", "--dump-dom", url],
                           capture_output=True, text=True, timeout=timeout_s)
        errors = tuple(line for line in p.stderr.splitlines() if ":CONSOLE" in line)
        return PageResult(errors, p.stdout, None, "dump-dom")
    finally:
        shutil.rmtree(ud, ignore_errors=True)


def load_page(path: Path, probe: str = "null", timeout_s: float = 45.0) -> PageResult:
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no chromium binary on PATH (apt-get install -y chromium)")
    url = Path(path).resolve().as_uri()
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        return _dump_dom(browser, url, timeout_s)
    return _cdp(browser, url, probe, timeout_s)
