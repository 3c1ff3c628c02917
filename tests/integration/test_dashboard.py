"""The coordinator's live page: its JSON shows the cluster and a job's plan and last step, and
the page itself renders them in a real headless browser (Chromium), with a screenshot kept in
``test-output/dashboard.png``. With a token, it takes it only in a header or through its login
form's cookie, never in a URL nor in a log line; with TLS it is HTTPS only."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
import trustme
from PIL import Image

import pipesvc
from tests.support.reference import PROBLEMS

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TOKEN = "s3cret-page-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def _page_url(log: Path) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"live page on (https?://\S+/)", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.1)
    raise AssertionError(f"no live page in {log}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, pipesvc.Job]]:
    """A 3-stage cluster with a token serving the page, with a gpt job 3 steps in."""
    problem = PROBLEMS["gpt"]
    token_file = tmp_path_factory.mktemp("page") / "token"
    token_file.write_text(TOKEN + "\n")
    with (
        pipesvc.LocalCluster(
            num_stages=3,
            threads_per_stage=1,
            token_file=token_file,
            coordinator_args=["--http-port", "0"],
            separate_hosts=True,
        ) as cluster,
        pipesvc.connect(cluster.address, token=TOKEN) as client,
        client.create_job(
            model=problem.model,
            model_args=problem.model_args,
            num_stages=3,
            loss=problem.loss,
            partition="uniform",
            wire_dtype={"activations": "int8", "gradients": "bfloat16"},
        ) as job,
    ):
        for step in range(3):
            job.train_step(*problem.batch(8, seed=step))
        yield _page_url(cluster.log_dir / "coordinator.log"), job


def _get(url: str, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def test_the_json_shows_stages_plans_and_the_last_step(trained: tuple[str, pipesvc.Job]) -> None:
    url, job = trained
    data = _get(url + "api/cluster", BEARER)
    assert [s["health"] for s in data["stages"]] == ["SERVING"] * 3
    (view,) = data["jobs"]
    assert view["id"] == job.id and view["step"] == 3
    assert [s["layers"] for s in view["stages"]] == [[s.start_layer, s.end_layer] for s in job.plan]
    assert view["stages"][-1]["layers"][1] == view["num_layers"]
    for stage in view["stages"]:
        assert stage["busy_ms"] > 0 and stage["step_ms"] >= stage["busy_ms"]
        assert stage["rss_mb"] > 10
    assert view["stages"][0]["send_mb_s"] > 0  # rank 0 sends activations downstream
    names = {(e["rank"], e["name"]) for e in view["timeline"]}
    assert {(r, n) for r in range(3) for n in ("forward", "backward")} <= names
    assert all(0 <= e["start_ms"] <= e["end_ms"] <= view["run_ms"] for e in view["timeline"])
    # Each link's codecs: the stages listen on loopback addresses of their own.
    assert view["links"] == [
        {
            "from": r,
            "to": r + 1,
            "between_hosts": True,
            "activations": "int8",
            "gradients": "bfloat16",
            "reason": "",  # said under wire_dtype="auto" (see test_auto_wire.py)
        }
        for r in range(2)
    ]


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="the live page's browser test needs Chromium, and neither chromium nor "
    "chromium-browser is on PATH: install it (`apt-get install chromium`, as .ci/run does)",
)
def test_the_page_renders_the_cluster_in_chromium(
    trained: tuple[str, pipesvc.Job], tmp_path: Path
) -> None:
    url, job = trained
    assert CHROMIUM is not None
    # The browser logs in as a person would, through the page's login form (filled and sent
    # by a local file here); the cookie it gets opens the page's data.
    login = tmp_path / "login.html"
    login.write_text(
        f'<form method="post" action="{url}login"><input name="token" value="{TOKEN}"></form>'
        "<script>document.forms[0].submit()</script>"
    )
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--virtual-time-budget=5000", "--window-size=1100,900"]  # fmt: skip
    dom = subprocess.run(
        [*common, "--dump-dom", login.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    # The script ran: the stage table, the job's plan bar and its timeline lanes are there.
    for stage in job.plan:
        assert stage.address in dom
        assert f"rank {stage.rank} [{stage.start_layer}, {stage.end_layer})" in dom
    assert f'data-job="{job.id}"' in dom and dom.count('class="lane"') == 3
    assert "3 stages, 1 jobs" in dom
    assert "rank 1 \u2192 2 (between hosts): activations int8, gradients bfloat16" in dom
    out = REPO / "test-output"
    out.mkdir(exist_ok=True)
    shot = out / "dashboard.png"
    shot.unlink(missing_ok=True)
    subprocess.run(
        [*common, f"--screenshot={shot}", login.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    image = Image.open(shot).convert("RGB")
    assert image.size == (1100, 900)
    colors = {color for _, color in image.getcolors(maxcolors=1 << 20) or []}
    for rank_color in ((0x33, 0x66, 0xCC), (0xDC, 0x39, 0x12), (0xFF, 0x99, 0x00)):
        assert rank_color in colors  # each rank's part of the plan bar was drawn
    print(f"screenshot: {shot}")


# -- access: token, login, TLS ----------------------------------------------------------------


@dataclasses.dataclass
class Page:
    """A coordinator process serving the page, logging at DEBUG into ``log``."""

    url: str
    log: Path
    tls: ssl.SSLContext | None
    """A client context that trusts the page and shows a client certificate (mutual TLS)."""
    ca: Path | None

    def request(
        self, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One request (no redirects followed): the status, headers and body."""
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        connection = (
            http.client.HTTPSConnection(parts.hostname, parts.port, timeout=30, context=self.tls)
            if self.tls is not None
            else http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        )
        try:
            connection.request(method, target, body=body, headers=headers or {})
            reply = connection.getresponse()
            return reply.status, reply.headers, reply.read()
        finally:
            connection.close()

    def login(self, token: str) -> tuple[int, http.client.HTTPMessage, bytes]:
        form = urlencode({"token": token}).encode()
        kind = {"Content-Type": "application/x-www-form-urlencoded"}
        return self.request("POST", "/login", form, kind)


def _pki(folder: Path) -> dict[str, Path]:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    files = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    leaf.private_key_pem.write_to_path(str(files["key"]))
    files["cert"].write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    return files


@contextlib.contextmanager
def _serve_page(tmp_path: Path, tls: bool) -> Iterator[Page]:
    """A coordinator with a token (and mutual TLS if ``tls``) serving the page."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    args = ["--token-file", str(token_file)]
    client_tls, pki = None, None
    if tls:
        pki = _pki(tmp_path)
        args += ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]
        args += ["--tls-ca", str(pki["ca"])]
        client_tls = ssl.create_default_context(cafile=pki["ca"])
        client_tls.load_cert_chain(pki["cert"], pki["key"])
    log = tmp_path / "coordinator.log"
    with open(log, "wb") as out:
        command = [sys.executable, "-m", "pipesvc", "--log-level", "DEBUG", "coordinator"]
        command += ["--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")]
        coordinator = subprocess.Popen(
            [*command, "--http-port", "0", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield Page(_page_url(log), log, client_tls, pki["ca"] if pki else None)
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=30)


@pytest.fixture(params=["plain", "tls"])
def page(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Page]:
    with _serve_page(tmp_path, tls=request.param == "tls") as serving:
        yield serving


def test_the_page_needs_the_token_in_a_header_or_the_login_cookie(page: Page) -> None:
    status, _, body = page.request("GET", "/api/cluster")
    assert status == 401 and b"/login" in body
    # The page itself holds no data; it sends a browser without a session to the login form.
    status, _, body = page.request("GET", "/")
    assert status == 200 and b'"/login"' in body
    status, _, body = page.request("GET", "/login")
    assert status == 200 and b'<form method="post" action="/login">' in body

    status, _, body = page.request("GET", "/api/cluster", headers=BEARER)
    assert status == 200 and json.loads(body)["stages"] == []
    wrong = {"Authorization": f"Bearer {TOKEN}x"}
    assert page.request("GET", "/api/cluster", headers=wrong)[0] == 401

    status, headers, _ = page.login(TOKEN + "x")
    assert status == 401 and headers.get("Set-Cookie") is None
    status, headers, _ = page.login(TOKEN)
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    attributes = {part.strip().lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= attributes
    assert ("secure" in attributes) == (page.tls is not None)
    session = cookie.split(";")[0]
    assert TOKEN not in session  # the cookie opens the page only, not the cluster's RPCs
    status, _, body = page.request("GET", "/api/cluster", headers={"Cookie": session})
    assert status == 200 and json.loads(body)["stages"] == []
    forged = {"Cookie": session[:-2] + "xx"}
    assert page.request("GET", "/api/cluster", headers=forged)[0] == 401
    assert TOKEN not in page.log.read_text(errors="replace")


def test_a_token_in_the_url_is_refused_and_never_logged(page: Page) -> None:
    for target in (f"/api/cluster?token={TOKEN}", f"/?token={TOKEN}", f"/login?token={TOKEN}"):
        status, _, body = page.request("GET", target)
        assert status == 400 and b"not accepted in the URL" in body
        assert b"Authorization: Bearer" in body and b"/login" in body
    # Refused even with the right header: a URL with the token must not become a habit.
    status, _, _ = page.request("GET", f"/api/cluster?token={TOKEN}", headers=BEARER)
    assert status == 400
    status, _, _ = page.request("POST", f"/login?token={TOKEN}")
    assert status == 400
    page.login(TOKEN)
    log = page.log.read_text(errors="replace")
    assert "GET /api/cluster?token=[secret]" in log  # the request lines are logged, scrubbed
    assert "POST /login" in log
    assert TOKEN not in log


def test_with_tls_the_page_is_https_only(tmp_path: Path) -> None:
    with _serve_page(tmp_path, tls=True) as page:
        assert page.url.startswith("https://") and page.ca is not None
        assert page.request("GET", "/api/cluster", headers=BEARER)[0] == 200
        # The OpenAI-compatible API shares the port, the token and the TLS.
        status, _, body = page.request("GET", "/v1/models", headers=BEARER)
        assert status == 200 and json.loads(body) == {"object": "list", "data": []}
        assert page.request("GET", "/v1/models")[0] == 401
        plain = page.url.replace("https://", "http://")
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
            _get(plain + "api/cluster", BEARER)
        # Mutual TLS: like every RPC, the page wants a client certificate from the cluster's CA.
        stranger = dataclasses.replace(page, tls=ssl.create_default_context(cafile=page.ca))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            stranger.request("GET", "/api/cluster", headers=BEARER)
        assert page.request("GET", "/api/cluster", headers=BEARER)[0] == 200  # still serving
        assert TOKEN not in page.log.read_text(errors="replace")
