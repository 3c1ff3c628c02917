"""The coordinator's live page: its JSON shows the cluster and a job's plan and last step, and
the page itself renders them in a real headless browser (Chromium), with a screenshot kept in
``test-output/dashboard.png``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import pipesvc
from tests.support.reference import PROBLEMS

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _page_url(cluster: pipesvc.LocalCluster) -> str:
    log = cluster.log_dir / "coordinator.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"live page on (http://\S+/)", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.1)
    raise AssertionError(f"no live page in {log}")


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[str, pipesvc.Job]]:
    """A 3-stage cluster serving the page, with a gpt job 3 steps in."""
    problem = PROBLEMS["gpt"]
    with (
        pipesvc.LocalCluster(
            num_stages=3, threads_per_stage=1, coordinator_args=["--http-port", "0"]
        ) as cluster,
        cluster.connect() as client,
        client.create_job(
            model=problem.model,
            model_args=problem.model_args,
            num_stages=3,
            loss=problem.loss,
            partition="uniform",
        ) as job,
    ):
        for step in range(3):
            job.train_step(*problem.batch(8, seed=step))
        yield _page_url(cluster), job


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def test_the_json_shows_stages_plans_and_the_last_step(trained: tuple[str, pipesvc.Job]) -> None:
    url, job = trained
    data = _get(url + "api/cluster")
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


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="the live page's browser test needs Chromium, and neither chromium nor "
    "chromium-browser is on PATH: install it (`apt-get install chromium`, as .ci/run does)",
)
def test_the_page_renders_the_cluster_in_chromium(trained: tuple[str, pipesvc.Job]) -> None:
    url, job = trained
    assert CHROMIUM is not None
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--virtual-time-budget=5000", "--window-size=1100,900"]  # fmt: skip
    dom = subprocess.run(
        [*common, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    # The script ran: the stage table, the job's plan bar and its timeline lanes are there.
    for stage in job.plan:
        assert stage.address in dom
        assert f"rank {stage.rank} [{stage.start_layer}, {stage.end_layer})" in dom
    assert f'data-job="{job.id}"' in dom and dom.count('class="lane"') == 3
    assert "3 stages, 1 jobs" in dom
    out = REPO / "test-output"
    out.mkdir(exist_ok=True)
    shot = out / "dashboard.png"
    shot.unlink(missing_ok=True)
    subprocess.run(
        [*common, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True
    )
    image = Image.open(shot).convert("RGB")
    assert image.size == (1100, 900)
    colors = {color for _, color in image.getcolors(maxcolors=1 << 20) or []}
    for rank_color in ((0x33, 0x66, 0xCC), (0xDC, 0x39, 0x12), (0xFF, 0x99, 0x00)):
        assert rank_color in colors  # each rank's part of the plan bar was drawn
    print(f"screenshot: {shot}")


def test_a_token_guards_the_page(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with pipesvc.LocalCluster(
        num_stages=1, token_file=token_file, coordinator_args=["--http-port", "0"]
    ) as cluster:
        url = _page_url(cluster)
        with pytest.raises(urllib.error.HTTPError) as refused:
            _get(url + "api/cluster")
        assert refused.value.code == 401
        refused.value.close()
        assert len(_get(url + "api/cluster?token=s3cret-token")["stages"]) == 1
        request = urllib.request.Request(
            url + "api/cluster", headers={"Authorization": "Bearer s3cret-token"}
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 200
