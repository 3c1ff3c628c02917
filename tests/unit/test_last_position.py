"""A generation forward runs the model's positionwise tail on the last position only (see
[Note: last position only] in pipesvc.stage.compute.layer_calls)."""

from __future__ import annotations

import torch
from torch import nn

from pipesvc.models import build_layers
from pipesvc.stage.compute.layer_calls import LayerCalls
from pipesvc.stage.compute.layer_plan import LayerCall, positionwise_tail

GPT = {"vocab_size": 50, "block_size": 32, "embed_dim": 32, "num_heads": 4, "num_blocks": 2}


def _plan(layers: list[nn.Module], start: int = 0) -> list[LayerCall]:
    return [(start + i, layer, False, (), False, False) for i, layer in enumerate(layers)]


def _calls(chunk: list[LayerCall]) -> LayerCalls:
    return LayerCalls(
        [chunk],
        seed=0,
        autocast=False,
        profile_wire=None,
        rank=0,
        ranges=[(0, len(chunk))],
        device=torch.device("cpu"),
    )


class _Seen(nn.Module):
    """A positionwise layer that records the shapes it is called on."""

    positionwise = True

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(list(x.shape))
        return x * 2


def test_the_tail_is_the_positionwise_layers_that_end_the_chunk() -> None:
    block, head = nn.Linear(4, 4), _Seen()
    assert positionwise_tail(_plan([block, head, _Seen()])) == 1
    assert positionwise_tail(_plan([head, block])) == 2  # a block after it: none
    assert positionwise_tail(_plan([block])) == 1
    assert positionwise_tail(_plan([_Seen(), _Seen()])) == 0
    assert positionwise_tail([]) == 0


def test_a_gpt_forward_for_the_last_position_gives_the_full_forwards_last_logits() -> None:
    layers = build_layers("gpt", GPT, seed=3, start_layer=0, end_layer=4)
    assert [getattr(layer, "positionwise", False) for layer in layers] == [False] * 3 + [True]
    calls = _calls(_plan(layers))
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = calls.apply(ids, 0, {})
        last = calls.apply(ids, 0, {}, last_position=True)
    assert full.shape == (3, 7, 50)
    assert last.shape == (3, 1, 50)
    torch.testing.assert_close(last, full[:, -1:])


def test_only_the_tail_sees_one_position() -> None:
    seen = _Seen()
    calls = _calls(_plan([nn.Identity(), seen]))
    x = torch.randn(2, 5, 4)
    out = calls.apply(x, 0, {}, last_position=True)
    assert seen.shapes == [[2, 1, 4]]
    torch.testing.assert_close(out, 2 * x[:, -1:])
    calls.apply(x, 0, {})  # a forward that returns every position
    assert seen.shapes[-1] == [2, 5, 4]


def test_a_chunk_that_does_not_end_in_the_tail_returns_every_position() -> None:
    layers = build_layers("gpt", GPT, seed=3, start_layer=0, end_layer=3)  # no head
    calls = _calls(_plan(layers))
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert calls.apply(ids, 0, {}, last_position=True).shape == (2, 6, 32)
