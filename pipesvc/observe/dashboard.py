"""The coordinator's live page: plain HTML and a small script, no build step.

``GET /`` is the page (static: it holds no data); ``GET /api/cluster`` the JSON it polls every
second (what ``pipesvc.coordinator.cluster_view.snapshot`` returns). With a token, the JSON
needs it as ``Authorization: Bearer TOKEN``, or the session cookie that ``POST /login`` (the
form at ``GET /login``, where the page sends a browser that has none) sets for the right token.

[Note: the page's token] The token authenticates every RPC of the cluster, so it never goes
into a URL (``?token=`` is refused: URLs end up in logs, proxies and browser history) and
never into a log line (every line is scrubbed of it and of the session). The cookie holds a
random session value of this server, not the token, so a leaked cookie opens only this page
and only until the coordinator restarts. With TLS the page is HTTPS only, with the cluster's
certificate, and with a CA (mutual TLS) it asks for a client certificate like every RPC does.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
import socket
import ssl
import sys
import tempfile
import threading
from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)

Snapshot = Callable[[], dict[str, Any]]

SESSION_COOKIE = "pipesvc_session"
_MAX_LOGIN_BYTES = 4096
_TIMEOUT_S = 30.0
"""How long a connection may take to finish its TLS handshake or send a request."""
_TOKEN_IN_URL = (
    b"the token is not accepted in the URL (URLs end up in logs and browser history): "
    b"log in at /login, or send it as an 'Authorization: Bearer TOKEN' header\n"
)
_LOGIN_NEEDED = b"log in at /login, or send the token as an 'Authorization: Bearer TOKEN' header\n"


def tls_context(cert: bytes, key: bytes, ca: bytes | None) -> ssl.SSLContext:
    """A server TLS context with ``cert`` and ``key`` (PEM); with ``ca``, clients must show a
    certificate signed by it (as on the cluster's gRPC servers)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # ssl loads a certificate chain from files only: a private directory, gone once read.
    with tempfile.TemporaryDirectory(prefix="pipesvc-page-") as folder:
        cert_file, key_file = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert_file.write_bytes(cert)
        key_file.touch(mode=0o600)
        key_file.write_bytes(key)
        context.load_cert_chain(cert_file, key_file)
    if ca is not None:
        context.load_verify_locations(cadata=ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def serve(
    snapshot: Snapshot,
    host: str,
    port: int,
    token: str | None,
    tls: ssl.SSLContext | None = None,
) -> ThreadingHTTPServer:
    """Starts the page on ``host:port`` (0: any free port) in a daemon thread, over HTTPS
    when ``tls`` is given; returns the server (``server.server_address`` has the port)."""
    session = secrets.token_urlsafe(32)
    secure = "; Secure" if tls is not None else ""

    def scrub(text: str) -> str:
        for secret in (token, session):
            if secret:
                text = text.replace(secret, "[secret]")
        return _TOKEN_PARAM.sub(r"\1[secret]", text)

    class Handler(BaseHTTPRequestHandler):
        timeout = _TIMEOUT_S

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if self._token_in_url(url.query):
                return
            if url.path == "/":
                self._send(200, "text/html; charset=utf-8", PAGE.encode())
            elif url.path == "/login":
                self._send(200, "text/html; charset=utf-8", _login_page(""))
            elif url.path == "/api/cluster":
                if not self._authorized():
                    self._send(401, "text/plain", _LOGIN_NEEDED)
                    return
                try:
                    body = json.dumps(snapshot()).encode()
                except Exception as exc:  # the page shows it and polls again
                    logger.warning("dashboard snapshot failed: %s", scrub(str(exc)))
                    self._send(500, "text/plain", str(exc).encode())
                    return
                self._send(200, "application/json", body)
            else:
                self._send(404, "text/plain", b"not found")

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            if self._token_in_url(url.query):
                return
            if url.path != "/login":
                self._send(404, "text/plain", b"not found")
                return
            try:
                size = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                size = -1
            if not 0 <= size <= _MAX_LOGIN_BYTES:
                self.close_connection = True
                self._send(413, "text/plain", b"a login form is at most 4096 bytes\n")
                return
            form = parse_qs(self.rfile.read(size).decode("utf-8", "replace"))
            given = (form.get("token") or [""])[0]
            if token is not None and not _same(given, token):
                self._send(401, "text/html; charset=utf-8", _login_page("wrong token"))
                return
            self.send_response(303)
            self.send_header("Location", "/")
            cookie = f"{SESSION_COOKIE}={session}; Path=/; HttpOnly; SameSite=Strict{secure}"
            self.send_header("Set-Cookie", cookie)
            self.send_header("Content-Length", "0")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()

        def _token_in_url(self, query: str) -> bool:
            if "token" not in parse_qs(query, keep_blank_values=True):
                return False
            self._send(400, "text/plain", _TOKEN_IN_URL)
            return True

        def _authorized(self) -> bool:
            if token is None:
                return True
            header = self.headers.get("Authorization", "")
            if header.startswith("Bearer "):
                return _same(header.removeprefix("Bearer "), token)
            try:
                morsel = SimpleCookie(self.headers.get("Cookie", "")).get(SESSION_COOKIE)
            except CookieError:
                return False
            return morsel is not None and _same(morsel.value, session)

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("dashboard: %s", scrub(format % args))

    server_class = _IPv6Server if ":" in host else _Server
    server = server_class((host, port), Handler, tls, scrub)
    threading.Thread(target=server.serve_forever, name="dashboard", daemon=True).start()
    return server


_TOKEN_PARAM = re.compile(r"(token=)[^&\s]*")


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


class _Server(ThreadingHTTPServer):
    """Accepts in one thread and does each connection's TLS handshake in its own thread, so
    a client that never finishes one does not hold up the others."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        tls: ssl.SSLContext | None,
        scrub: Callable[[str], str],
    ) -> None:
        super().__init__(address, handler)
        self.tls = tls
        self.scrub = scrub

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        if self.tls is not None:
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, address

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            request.settimeout(_TIMEOUT_S)
            try:
                request.do_handshake()
            except OSError as exc:  # plain HTTP on the HTTPS port, a stranger's certificate
                logger.debug("dashboard: TLS handshake with %s failed: %s", client_address, exc)
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints a traceback to stderr; a dropped connection is no news.
        error = self.scrub(repr(sys.exc_info()[1]))
        logger.debug("dashboard: a request from %s failed: %s", client_address, error)


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


def _login_page(problem: str) -> bytes:
    note = f'<p class="problem">{problem}</p>' if problem else ""
    return LOGIN.replace("<!--problem-->", note).encode()


LOGIN = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pipesvc: log in</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 20px; color: #222; }
  .problem { color: #c00; }
</style>
</head>
<body>
<h1>pipesvc</h1>
<!--problem-->
<form method="post" action="/login">
  <label>cluster token <input type="password" name="token" autocomplete="off" autofocus></label>
  <button type="submit">log in</button>
</form>
</body>
</html>
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pipesvc</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 20px; color: #222; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 16px; margin: 24px 0 8px; }
  table { border-collapse: collapse; margin: 6px 0; }
  th, td { padding: 3px 10px; border-bottom: 1px solid #ddd; text-align: right; }
  th:first-child, td:first-child { text-align: left; }
  .bar { display: flex; height: 28px; border: 1px solid #999; width: 900px; }
  .bar div { overflow: hidden; white-space: nowrap; font-size: 12px; padding: 6px 4px;
             color: #fff; border-right: 1px solid #fff; box-sizing: border-box; }
  .lane { position: relative; height: 18px; width: 900px; background: #f4f4f4;
          margin: 2px 0; }
  .lane span { position: absolute; top: 0; height: 18px; }
  .SERVING { color: #080; } .NOT_SERVING, .UNREACHABLE { color: #c00; }
  #status { color: #666; }
  .legend span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; }
</style>
</head>
<body>
<h1>pipesvc</h1>
<div id="status">loading...</div>
<h2>Stages</h2>
<table id="stages"></table>
<div id="jobs"></div>
<script>
const COLORS = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477",
                "#66aa00", "#b82e2e", "#316395"];
const SPANS = {forward: "#3366cc", backward: "#109618", weight: "#dc3912", wait: "#dddddd",
               send: "#ff9900", reduce: "#990099"};
const fmt = (v, digits) => v === null || v === undefined ? "-" : v.toFixed(digits);
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function row(table, cells, header) {
  const tr = el("tr");
  for (const c of cells) tr.appendChild(el(header ? "th" : "td", {}, String(c)));
  table.appendChild(tr);
  return tr;
}
function render(data) {
  const stages = document.getElementById("stages");
  stages.replaceChildren();
  row(stages, ["stage", "health", "device", "job", "rank", "layers", "RSS MiB", "budget MiB"],
      true);
  for (const s of data.stages) {
    const tr = row(stages, [s.address, s.health, s.device, s.job || "-",
      s.rank === null ? "-" : s.rank, s.layers ? "[" + s.layers[0] + ", " + s.layers[1] + ")" : "-",
      fmt(s.rss_mb, 0), fmt(s.memory_budget_mb, 0)]);
    tr.children[1].className = s.health;
  }
  const jobs = document.getElementById("jobs");
  jobs.replaceChildren();
  for (const job of data.jobs) {
    jobs.appendChild(el("h2", {}, "job " + job.id + ": " + job.model + ", step " + job.step +
      ", partition " + job.partition));
    // A job with replicas (data parallel) gets one bar per replica.
    const replicas = [...new Set(job.stages.map(s => s.replica))];
    const who = s => (replicas.length > 1 ? "replica " + s.replica + " " : "") + "rank " + s.rank;
    for (const r of replicas) {
      const bar = el("div", {class: "bar", "data-job": job.id});
      for (const s of job.stages.filter(s => s.replica === r)) {
        const part = el("div", {title: s.address},
          who(s) + " [" + s.layers[0] + ", " + s.layers[1] + ") " + s.address);
        part.style.width = (100 * (s.layers[1] - s.layers[0]) / job.num_layers) + "%";
        part.style.background = COLORS[s.rank % COLORS.length];
        bar.appendChild(part);
      }
      jobs.appendChild(bar);
    }
    // Each link's codecs (see [Note: codecs per link] in pipesvc/core/link_codecs.py).
    // Under wire_dtype "auto" each link also says why it has its codecs.
    if (job.links.some(l => l.activations !== "exact" || l.gradients !== "exact" || l.reason)) {
      const where = l => l.between_hosts ? " (between hosts)" : " (one host)";
      jobs.appendChild(el("p", {class: "links"}, "links: " + job.links.map(l =>
        "rank " + l.from + " \u2192 " + l.to + where(l) + ": activations " + l.activations +
        ", gradients " + l.gradients + (l.reason ? " \u2014 " + l.reason : "")).join("; ")));
    }
    const table = el("table");
    row(table, ["rank", "stage", "step ms", "busy ms", "wait ms", "idle ms", "RSS MiB",
                "send MB/s"], true);
    for (const s of job.stages) {
      row(table, [who(s), s.address, fmt(s.step_ms, 1), fmt(s.busy_ms, 1), fmt(s.wait_ms, 1),
                  fmt(s.idle_ms, 1), fmt(s.rss_mb, 0), fmt(s.send_mb_s, 0)]);
    }
    jobs.appendChild(table);
    jobs.appendChild(el("div", {}, "last run: " + fmt(job.run_ms, 1) + " ms"));
    const legend = el("div", {class: "legend"});
    for (const [name, color] of Object.entries(SPANS)) {
      const sw = el("span"); sw.style.background = color;
      legend.appendChild(sw); legend.appendChild(document.createTextNode(name));
    }
    jobs.appendChild(legend);
    for (const s of job.stages) {
      const lane = el("div", {class: "lane", title: who(s)});
      for (const e of job.timeline.filter(e => e.rank === s.rank && e.replica === s.replica)) {
        const span = el("span", {title: e.name + " " + e.microbatch});
        span.style.left = (100 * e.start_ms / Math.max(job.run_ms, 1e-9)) + "%";
        span.style.width = Math.max(0.2, 100 * (e.end_ms - e.start_ms) /
                                    Math.max(job.run_ms, 1e-9)) + "%";
        span.style.background = SPANS[e.name] || "#999";
        lane.appendChild(span);
      }
      jobs.appendChild(lane);
    }
  }
  document.getElementById("status").textContent = data.stages.length + " stages, " +
    data.jobs.length + " jobs; updated " + new Date(data.time * 1000).toLocaleTimeString();
}
async function poll() {
  try {
    const reply = await fetch("/api/cluster", {cache: "no-store", credentials: "same-origin"});
    if (reply.status === 401) { window.location.href = "/login"; return; }
    if (!reply.ok) throw new Error(reply.status + " " + await reply.text());
    render(await reply.json());
  } catch (err) {
    document.getElementById("status").textContent = "error: " + err.message;
  }
  setTimeout(poll, 1000);
}
poll();
</script>
</body>
</html>
"""
