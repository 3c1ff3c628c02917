"""The coordinator's live page: plain HTML and a small script, no build step.

``GET /`` is the page; ``GET /api/cluster`` the JSON it polls every second (what
``pipesvc.coordinator.cluster_view.snapshot`` returns). With a token, both need it, as
``Authorization: Bearer TOKEN`` or ``?token=TOKEN`` (the page passes its own query on).
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)

Snapshot = Callable[[], dict[str, Any]]


def serve(snapshot: Snapshot, host: str, port: int, token: str | None) -> ThreadingHTTPServer:
    """Starts the page on ``host:port`` (0: any free port) in a daemon thread; returns the
    server (``server.server_address`` has the port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if token is not None and not _authorized(self, url.query, token):
                self._send(401, "text/plain", b"a token is needed: ?token=... or a Bearer header")
                return
            if url.path == "/":
                self._send(200, "text/html; charset=utf-8", PAGE.encode())
            elif url.path == "/api/cluster":
                try:
                    body = json.dumps(snapshot()).encode()
                except Exception as exc:  # the page shows it and polls again
                    logger.warning("dashboard snapshot failed: %s", exc)
                    self._send(500, "text/plain", str(exc).encode())
                    return
                self._send(200, "application/json", body)
            else:
                self._send(404, "text/plain", b"not found")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("dashboard: " + format, *args)

    server_class = _IPv6Server if ":" in host else ThreadingHTTPServer
    server = server_class((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="dashboard", daemon=True).start()
    return server


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _authorized(handler: BaseHTTPRequestHandler, query: str, token: str) -> bool:
    header = handler.headers.get("Authorization", "")
    given = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
    if given is None:
        given = (parse_qs(query).get("token") or [""])[0]
    return hmac.compare_digest(given.encode(), token.encode())


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
const query = window.location.search;
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
    const reply = await fetch("/api/cluster" + query, {cache: "no-store"});
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
