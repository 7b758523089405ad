"""Headless Chromium driven over the Chrome DevTools Protocol through a pipe.

`--remote-debugging-pipe` makes the browser read commands from fd 3 and write answers and
events to fd 4, as JSON messages ended by a NUL byte. No port, no websocket library and
no driver binary: the standard library is enough. One reader thread routes answers to the
callers waiting on them and keeps the page's console errors and uncaught exceptions.

    with Chromium.launch(tmp_dir) as browser:
        page = browser.new_page(1280, 900)
        page.goto("http://127.0.0.1:8000/")
        page.evaluate("document.title")
        page.screenshot("chat.png")
        assert not page.errors

`find_chromium()` returns the browser binary or None (tests skip with the reason).
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
from typing import Any

# The flags that work as root in a container; a fresh profile per launch.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
         "--remote-debugging-pipe")
CALL_TIMEOUT_S = 60.0
NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The browser to drive: $DUET_CHROMIUM, else the first of NAMES on PATH."""
    path = os.environ.get("DUET_CHROMIUM")
    if path:
        return path if os.access(path, os.X_OK) else None
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class CDPError(RuntimeError):
    pass


class Chromium:
    """A browser process and its pipe. Use `launch` and close it (or `with`)."""

    def __init__(self, proc: subprocess.Popen, to_browser: int, from_browser: int) -> None:
        self.proc, self._out, self._in = proc, to_browser, from_browser
        self._lock = threading.Lock()
        self._next_id = 0
        self._waiting: dict[int, tuple[threading.Event, list]] = {}
        self._listeners: dict[str, list] = {}           # sessionId -> [callback(msg)]
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, user_data_dir: str, binary: str | None = None) -> "Chromium":
        binary = binary or find_chromium()
        if binary is None:
            raise FileNotFoundError("no Chromium found")
        to_r, to_w = os.pipe()          # commands: we write, the browser reads on fd 3
        from_r, from_w = os.pipe()      # answers: the browser writes on fd 4
        # NOTE: the child's ends are moved above any fd a child might hold, then a tiny
        # Python trampoline puts them on 3 and 4 and execs the browser (a preexec_fn
        # would race subprocess's own descriptors in the child; /bin/sh knows fds < 10).
        child_r = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
        for fd in (to_r, from_w):
            os.close(fd)
        argv = [binary, *FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"]
        trampoline = (f"import os; os.dup2({child_r}, 3); os.dup2({child_w}, 4); "
                      f"os.close({child_r}); os.close({child_w}); "
                      f"os.execv({binary!r}, {argv!r})")
        proc = subprocess.Popen([sys.executable, "-c", trampoline],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, pass_fds=(child_r, child_w))
        to_r, from_w = child_r, child_w
        os.close(to_r)
        os.close(from_w)
        return cls(proc, to_w, from_r)

    # -- protocol -------------------------------------------------------------------------
    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._in, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                self._dispatch(json.loads(raw))
        with self._lock:                 # the browser is gone: wake every waiter
            for event, box in self._waiting.values():
                box.append({"error": {"message": "the browser closed the pipe"}})
                event.set()

    def _dispatch(self, msg: dict) -> None:
        if "id" in msg:
            with self._lock:
                waiter = self._waiting.pop(msg["id"], None)
            if waiter is not None:
                waiter[1].append(msg)
                waiter[0].set()
            return
        for fn in list(self._listeners.get(msg.get("sessionId", ""), ())):
            fn(msg)

    def call(self, method: str, session: str | None = None, timeout: float = CALL_TIMEOUT_S,
             **params: Any) -> dict:
        """Send one command and wait for its answer's result (CDPError on an error)."""
        event, box = threading.Event(), []
        with self._lock:
            self._next_id += 1
            msg_id = self._next_id
            self._waiting[msg_id] = (event, box)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        if not event.wait(timeout):
            raise CDPError(f"{method}: no answer in {timeout} s")
        answer = box[0]
        if "error" in answer:
            raise CDPError(f"{method}: {answer['error'].get('message')}")
        return answer.get("result", {})

    def listen(self, session: str, fn) -> None:
        self._listeners.setdefault(session, []).append(fn)

    # -- pages ----------------------------------------------------------------------------
    def new_page(self, width: int = 1280, height: int = 900) -> "Page":
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target,
                            flatten=True)["sessionId"]
        page = Page(self, session)
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(method, session)
        self.call("Emulation.setDeviceMetricsOverride", session, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        return page

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("Browser.close", timeout=5.0)
            except CDPError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Page:
    """One tab. `errors` collects console errors, uncaught exceptions and failed loads."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser, self.session = browser, session
        self.errors: list[str] = []
        self._loaded = threading.Event()
        browser.listen(session, self._on_event)

    def _on_event(self, msg: dict) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(
                str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append("exception: " + str(
                details.get("exception", {}).get("description") or details.get("text")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log: {entry.get('text')} {entry.get('url', '')}".strip())
        elif method == "Page.loadEventFired":
            self._loaded.set()

    def call(self, method: str, **params: Any) -> dict:
        return self.browser.call(method, self.session, **params)

    def goto(self, url: str, timeout: float = CALL_TIMEOUT_S) -> None:
        """Navigate and wait for the load event (CDPError when it does not come)."""
        self._loaded.clear()
        self.call("Page.bringToFront")      # headless shows one tab; the others are hidden
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise CDPError(f"navigating to {url}: {result['errorText']}")
        if not self._loaded.wait(timeout):
            raise CDPError(f"{url}: no load event in {timeout} s")

    def evaluate(self, expression: str, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The value of a JS expression (promises awaited), returned by value."""
        result = self.browser.call("Runtime.evaluate", self.session, timeout=timeout,
                                   expression=expression, awaitPromise=True,
                                   returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CDPError(f"evaluate failed: "
                           f"{details.get('exception', {}).get('description') or details}")
        return result.get("result", {}).get("value")

    def wait_for(self, condition: str, timeout_s: float = 60.0, poll_ms: int = 100) -> Any:
        """Evaluate `condition` in the page every poll_ms until it is truthy; return its
        value. CDPError after timeout_s (the page's own clock, checked in the page)."""
        script = f"""new Promise((resolve, reject) => {{
            const deadline = performance.now() + {timeout_s * 1000};
            const check = () => {{
                let v;
                try {{ v = ({condition}); }} catch (e) {{ v = undefined; }}
                if (v) return resolve(v);
                if (performance.now() > deadline) return reject(new Error(
                    "timed out waiting for: " + {json.dumps(condition)}));
                setTimeout(check, {poll_ms});
            }};
            check();
        }})"""
        return self.evaluate(script, timeout=timeout_s + 30)

    def screenshot(self, path: str) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
