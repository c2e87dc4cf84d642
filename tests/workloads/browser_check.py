#!/usr/bin/env python3
"""Opens a page in headless Chromium and reports what a user would see (tests only).

Drives Chromium through the DevTools protocol over its `--remote-debugging-pipe` (file
descriptors 3 and 4, messages ending in NUL), so it needs nothing but the standard library and
the browser. Prints one JSON object on stdout:

- `errors`: console errors, uncaught exceptions and log-domain errors, as text;
- `requests`: every URL the page asked for besides itself (a self-contained page asks none);
- `dom`: what `--eval` expressions returned after the load (each evaluated in the page);
- `clicks`: per `--click FRACTION`, the values of `--after` expressions once the page's canvas
  `--canvas` was clicked at that fraction of its plotting width, half its height;
- `ready`, `load_ms`: whether the page set its `data-ready` attribute, and when (from the
  navigation); a page that never does is read no further, its errors say why.

`--screenshot FILE` keeps a PNG of the page after the last click.
"""

import argparse
import base64
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--remote-debugging-pipe"]


class Browser:
    def __init__(self, chromium, profile, width, height):
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()
        # Out of the way of 3 and 4, which the shell below fills.
        for fd in (to_child_r, from_child_w):
            high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
            os.close(fd)
            if fd == to_child_r:
                to_child_r = high
            else:
                from_child_w = high
        # The child gets its ends as fds 3 (commands in) and 4 (replies out), moved there by a
        # shell: subprocess closes every descriptor it was not told to pass.
        argv = [chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_child_r} 4>&{from_child_w} {to_child_r}<&- {from_child_w}>&-', "bash", *argv],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=(to_child_r, from_child_w))
        os.close(to_child_r)
        os.close(from_child_w)
        self.buf = b""
        self.next_id = 0
        self.events = []

    def send(self, method, params=None, session=None, timeout=30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.read(deadline)
            if m is None:
                break
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)
        raise TimeoutError(f"{method}: no reply in {timeout} s")

    def read(self, deadline):
        while b"\0" not in self.buf:
            if time.time() > deadline:
                return None
            chunk = os.read(self.from_child, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe: " + self.proc.stderr.read().decode(errors="replace")[-2000:])
            self.buf += chunk
        line, self.buf = self.buf.split(b"\0", 1)
        return json.loads(line)

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except Exception:  # noqa: BLE001 - closing is best effort; the process is killed below
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def evaluate(b, session, expr):
    r = b.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True}, session)
    if "exceptionDetails" in r:
        raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
    return r["result"].get("value")


def wait_for(b, session, expr, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if evaluate(b, session, expr):
            return True
        time.sleep(0.05)
    return False


def click(b, session, canvas, fraction):
    """Clicks the canvas at `fraction` of its plotting area (the page's left margin is 70 px)."""
    rect = evaluate(b, session, f"(() => {{ const c = document.getElementById({json.dumps(canvas)}); c.scrollIntoView(); "
                                "const r = c.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; })()")
    left, top, width, height = rect
    x = left + 70 + fraction * (width - 80)
    y = top + height / 2
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        b.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}, session)


def problems(events, page_url):
    errors, requests = [], []
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            errors.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            errors.append("log: " + p["entry"].get("text", ""))
        elif method == "Network.requestWillBeSent":
            url = p.get("request", {}).get("url", "")
            if url != page_url:
                requests.append(url)
    return errors, requests


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--eval", action="append", default=[], help="NAME=EXPR read after the load")
    ap.add_argument("--canvas", default="timeline")
    ap.add_argument("--click", action="append", type=float, default=[], help="fraction of the canvas width")
    ap.add_argument("--after", action="append", default=[], help="NAME=EXPR read after each click")
    ap.add_argument("--screenshot")
    ap.add_argument("--size", default="1400,1000")
    ap.add_argument("--timeout", type=float, default=60, help="seconds the page may take to draw")
    args = ap.parse_args()

    width, height = (int(v) for v in args.size.split(","))
    url = "file://" + os.path.abspath(args.page)
    out = {"errors": [], "requests": [], "dom": {}, "clicks": []}
    with tempfile.TemporaryDirectory(prefix="memscope-chromium-") as profile:
        b = Browser(args.chromium, profile, width, height)
        try:
            target = b.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = b.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Network", "Page"):
                b.send(f"{domain}.enable", session=session)
            b.send("Emulation.setDeviceMetricsOverride",
                   {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
            started = time.time()
            b.send("Page.navigate", {"url": url}, session)
            ready = "document.body && document.body.getAttribute('data-ready') === '1'"
            out["ready"] = wait_for(b, session, ready, args.timeout)
            out["load_ms"] = round((time.time() - started) * 1000)
            for spec in args.eval if out["ready"] else []:
                name, expr = spec.split("=", 1)
                out["dom"][name] = evaluate(b, session, expr)
            for fraction in args.click if out["ready"] else []:
                click(b, session, args.canvas, fraction)
                time.sleep(0.1)
                out["clicks"].append({name: evaluate(b, session, expr)
                                      for name, expr in (s.split("=", 1) for s in args.after)})
            if args.screenshot:
                shot = b.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
                with open(args.screenshot, "wb") as f:
                    f.write(base64.b64decode(shot["data"]))
            time.sleep(0.2)
            b.send("Runtime.evaluate", {"expression": "1"}, session)  # drains the events queued meanwhile
            out["errors"], out["requests"] = problems(b.events, url)
        finally:
            b.close()
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
