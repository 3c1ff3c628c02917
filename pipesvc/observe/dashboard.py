"""The coordinator's live page: plain HTML and a small script, no build step.

``GET /`` is the page (static: it holds no data); ``GET /api/cluster`` the JSON it polls every
second (what ``pipesvc.coordinator.cluster_view.snapshot`` returns). With a token, the JSON
needs it as ``Authorization: Bearer TOKEN``, or the session cookie that ``POST /login`` (the
form at ``GET /login``, where the page sends a browser that has none) sets for the right token.
The routes live in the coordinator's one HTTP app (``pipesvc.coordinator.serve_http.app``),
beside the OpenAI-compatible API, served by uvicorn.

[Note: the page's token] The token authenticates every RPC of the cluster, so it never goes
into a URL (``?token=`` is refused: URLs end up in logs, proxies and browser history) and
never into a log line (every line is scrubbed of it and of the session). The cookie holds a
random session value of this server, not the token
(``pipesvc.coordinator.serve_http.access``), so a leaked cookie opens only this page and only
until the coordinator restarts. With TLS the page is HTTPS only, with the cluster's
certificate, and with a CA (mutual TLS) it asks for a client certificate like every RPC does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import parse_qs

import anyio
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import Route


class Access(Protocol):
    """Who may read the page's data (``pipesvc.coordinator.serve_http.access.Access``)."""

    def page(self, request: Request) -> bool:
        """The request may read the page's data (the token, or the login cookie)."""
        ...

    def is_token(self, given: str) -> bool:
        """``given`` is the cluster's token."""
        ...

    def cookie(self) -> str:
        """The ``Set-Cookie`` value of a successful login."""
        ...

    def scrub(self, text: str) -> str:
        """``text`` without the token and the session."""
        ...


logger = logging.getLogger(__name__)

Snapshot = Callable[[], dict[str, Any]]

_MAX_LOGIN_BYTES = 4096
_LOGIN_NEEDED = "log in at /login, or send the token as an 'Authorization: Bearer TOKEN' header\n"
_NO_STORE = {"Cache-Control": "no-store"}


def routes(snapshot: Snapshot, access: Access) -> list[Route]:
    """The page's routes, for the coordinator's HTTP app
    (``pipesvc.coordinator.serve_http.app``), which refuses a token in any URL before they see
    the request."""

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE, headers=_NO_STORE)

    async def login_form(request: Request) -> Response:
        return HTMLResponse(_login_page(""), headers=_NO_STORE)

    async def cluster(request: Request) -> Response:
        if not access.page(request):
            return PlainTextResponse(_LOGIN_NEEDED, status_code=401, headers=_NO_STORE)
        try:
            # It asks the stages: in a worker thread, so the event loop keeps serving streams.
            body = json.dumps(await anyio.to_thread.run_sync(snapshot))
        except Exception as exc:  # the page shows it and polls again
            logger.warning("dashboard snapshot failed: %s", access.scrub(str(exc)))
            return PlainTextResponse(str(exc), status_code=500, headers=_NO_STORE)
        return Response(body, media_type="application/json", headers=_NO_STORE)

    async def login(request: Request) -> Response:
        try:
            size = int(request.headers.get("content-length", "0"))
        except ValueError:
            size = -1
        if not 0 <= size <= _MAX_LOGIN_BYTES:
            return PlainTextResponse(
                "a login form is at most 4096 bytes\n",
                status_code=413,
                headers={**_NO_STORE, "Connection": "close"},
            )
        # Read by hand: starlette's form parser needs python-multipart, for one field.
        form = parse_qs((await request.body())[:_MAX_LOGIN_BYTES].decode("utf-8", "replace"))
        given = (form.get("token") or [""])[0]
        if not access.is_token(given):
            return HTMLResponse(_login_page("wrong token"), status_code=401, headers=_NO_STORE)
        headers = {**_NO_STORE, "Location": "/", "Set-Cookie": access.cookie()}
        return Response(b"", status_code=303, headers=headers)

    return [
        Route("/", page, methods=["GET"]),
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/api/cluster", cluster, methods=["GET"]),
    ]


def _login_page(problem: str) -> str:
    note = f'<p class="problem">{problem}</p>' if problem else ""
    return LOGIN.replace("<!--problem-->", note)


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
