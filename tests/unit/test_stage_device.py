"""The stage's device: what ``--device`` and its default resolve to, and the clear refusals.

CUDA's own calls that pin a device (``torch.cuda.set_device``, ``mem_get_info``) refuse a
device without an index, which made every stage started without ``--device`` on a GPU host
exit at once. The CUDA cases fake torch's device count at its seam; the CPU ones are real.
"""

from __future__ import annotations

import pytest
import torch

from pipesvc.errors import InvalidArgumentError
from pipesvc.stage.server import stage_device


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


@pytest.mark.parametrize(
    ("name", "current", "expected"),
    [(None, 0, "cuda:0"), ("", 1, "cuda:1"), ("cuda", 1, "cuda:1"), ("cuda:1", 0, "cuda:1")],
)
def test_cuda_always_comes_with_an_index(
    monkeypatch: pytest.MonkeyPatch, name: str | None, current: int, expected: str
) -> None:
    fake_gpus(monkeypatch, 2, current)
    device = stage_device(name)
    assert device == torch.device(expected)
    assert device.index is not None


def test_a_gpu_the_host_lacks_is_refused_with_the_ones_it_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_gpus(monkeypatch, 2)
    with pytest.raises(
        InvalidArgumentError, match=r"'cuda:2'.* 2 CUDA device\(s\), cuda:0 to cuda:1"
    ):
        stage_device("cuda:2")


def test_the_cpu_is_the_default_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    assert stage_device(None) == torch.device("cpu")
    assert stage_device("cpu") == torch.device("cpu")
    with pytest.raises(InvalidArgumentError, match=r"'cuda'.* no CUDA device"):
        stage_device("cuda")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "meta", "cpu:0:1"])
def test_a_name_that_is_no_stage_device_is_refused(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=repr(name)):
        stage_device(name)
