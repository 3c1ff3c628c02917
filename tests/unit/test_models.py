"""Unit tests of the model registry and the built-in models."""

from __future__ import annotations

import resource
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipesvc.models as models
from pipesvc.errors import InvalidArgumentError, UnknownModelError
from pipesvc.models import registry

SMALL_ARGS: dict[str, dict[str, Any]] = {
    "mlp": {"in_features": 6, "hidden_features": 10, "out_features": 3, "num_layers": 5},
    "gpt": {"vocab_size": 32, "block_size": 12, "embed_dim": 16, "num_heads": 2, "num_blocks": 3},
    "cnn": {"in_channels": 2, "image_size": 8, "num_classes": 5, "channels": [4, 6]},
}


@pytest.fixture
def isolated_registry() -> Iterator[None]:
    """Lets a test register models without leaking them into other tests."""
    with registry._FACTORIES.scratch():
        yield


def test_all_is_sorted_and_complete() -> None:
    assert models.__all__ == sorted(models.__all__)
    for name in models.__all__:
        assert hasattr(models, name), name
    assert {"mlp", "gpt", "cnn"} <= set(models.known_models())
    assert models.known_models() == sorted(models.known_models())


@pytest.mark.parametrize("name", sorted(SMALL_ARGS))
def test_any_range_equals_full_build(name: str) -> None:
    args = SMALL_ARGS[name]
    full = models.build(name, seed=7, **args)
    num_layers = len(full)
    for start in range(num_layers):
        for end in range(start + 1, num_layers + 1):
            part = models.build_layers(name, args, seed=7, start_layer=start, end_layer=end)
            assert len(part) == end - start
            for offset, layer in enumerate(part):
                expected = full[start + offset].state_dict()
                got = layer.state_dict()
                assert got.keys() == expected.keys()
                for key in expected:
                    assert torch.equal(got[key], expected[key]), (start, end, offset, key)


def test_build_layers_builds_only_the_range(isolated_registry: None) -> None:
    built: list[int] = []

    def make(index: int) -> nn.Module:
        built.append(index)
        return nn.Linear(2, 2)

    @models.register_model("counting")
    def counting() -> list[models.LayerSpec]:
        return [models.LayerSpec(make, i) for i in range(6)]

    models.build_layers("counting", {}, seed=0, start_layer=2, end_layer=4)
    assert built == [2, 3]


@pytest.mark.parametrize("name", sorted(SMALL_ARGS))
def test_build_leaves_global_rng_untouched(name: str) -> None:
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    models.build(name, seed=3, **SMALL_ARGS[name])
    models.build_layers(name, SMALL_ARGS[name], seed=3, start_layer=0, end_layer=2)
    models.describe(name, SMALL_ARGS[name])
    assert torch.equal(torch.get_rng_state(), before)


def test_build_is_independent_of_global_rng() -> None:
    torch.manual_seed(1)
    a = models.build("mlp", seed=5)
    torch.manual_seed(2)
    b = models.build("mlp", seed=5)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key])


@pytest.mark.parametrize("name", sorted(SMALL_ARGS))
def test_different_seeds_give_different_weights(name: str) -> None:
    a = models.build(name, seed=0, **SMALL_ARGS[name]).state_dict()
    b = models.build(name, seed=1, **SMALL_ARGS[name]).state_dict()
    weights = [k for k in a if k.endswith("weight") and not torch.all(a[k] == 1)]
    assert weights
    assert all(not torch.equal(a[k], b[k]) for k in weights)


def test_layers_differ_from_each_other() -> None:
    net = models.build("gpt", seed=0, **SMALL_ARGS["gpt"])
    state = net.state_dict()
    assert not torch.equal(state["1.attn.qkv.weight"], state["2.attn.qkv.weight"])


def test_layer_seed_is_stable_and_in_range() -> None:
    # Pinned: a change here changes every model's initial weights.
    assert models.layer_seed(0, 0) == 3405039997849428244
    assert models.layer_seed(0, 1) == 2582024758138804689
    seeds = {models.layer_seed(s, i) for s in range(-3, 20) for i in range(20)}
    assert len(seeds) == 23 * 20
    assert all(0 <= s < 2**63 for s in seeds)
    assert models.layer_seed(2**80, 5) == models.layer_seed(2**80, 5)


def test_build_state_dict_keys() -> None:
    net = models.build("mlp", seed=0, num_layers=3)
    assert isinstance(net, nn.Sequential)
    assert list(net.state_dict()) == [
        "0.0.weight",
        "0.0.bias",
        "1.0.weight",
        "1.0.bias",
        "2.weight",
        "2.bias",
    ]
    gpt_keys = list(models.build("gpt", seed=0, **SMALL_ARGS["gpt"]).state_dict())
    assert gpt_keys[0] == "0.token.weight"
    assert "4.lm_head.weight" in gpt_keys
    assert all(k.split(".")[0].isdigit() for k in gpt_keys)


@pytest.mark.parametrize("name", sorted(SMALL_ARGS))
def test_describe_matches_real_model(name: str) -> None:
    args = SMALL_ARGS[name]
    desc = models.describe(name, args)
    net = models.build(name, seed=0, **args)
    assert desc.name == name
    assert desc.num_layers == len(net)
    assert desc.parameter_counts == [sum(p.numel() for p in layer.parameters()) for layer in net]
    for index, (info, layer) in enumerate(zip(desc.layers, net, strict=True)):
        assert info.index == index
        params = list(layer.parameters())
        assert info.parameter_bytes == sum(p.numel() * p.element_size() for p in params)
        state = layer.state_dict()
        assert [t.name for t in info.tensors] == list(state)
        for tensor in info.tensors:
            assert tensor.shape == tuple(state[tensor.name].shape)
            assert tensor.dtype == "float32"


def test_describe_huge_models_is_instant_and_allocates_nothing() -> None:
    models.describe("gpt", {"embed_dim": 64})  # warm up lazy meta-kernel registration
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    mlp = models.describe("mlp", {"hidden_features": 100_000, "num_layers": 4})
    gpt = models.describe(
        "gpt", {"vocab_size": 50_000, "embed_dim": 8192, "num_heads": 64, "num_blocks": 12}
    )
    elapsed_s = time.perf_counter() - start
    assert sum(mlp.parameter_counts) > 2 * 10**10
    assert sum(gpt.parameter_counts) > 10**10
    assert sum(layer.parameter_bytes for layer in mlp.layers) == 4 * sum(mlp.parameter_counts)
    assert elapsed_s < 5.0
    # ru_maxrss is in KiB on Linux; 40+ GB of float32 weights would show up here.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1024 * 1024


def test_forward_shapes() -> None:
    mlp = models.build("mlp", seed=0, **SMALL_ARGS["mlp"])
    assert mlp(torch.randn(4, 6)).shape == (4, 3)
    gpt = models.build("gpt", seed=0, **SMALL_ARGS["gpt"])
    tokens = torch.randint(0, 32, (3, 12))
    assert gpt(tokens).shape == (3, 12, 32)
    assert gpt(tokens[:, :5]).shape == (3, 5, 32)
    cnn = models.build("cnn", seed=0, **SMALL_ARGS["cnn"])
    assert cnn(torch.randn(2, 2, 8, 8)).shape == (2, 5)


def test_gpt_is_causal_and_checks_length() -> None:
    gpt = models.build("gpt", seed=0, **SMALL_ARGS["gpt"])
    tokens = torch.randint(0, 32, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 32
    torch.testing.assert_close(gpt(tokens)[:, :6], gpt(changed)[:, :6])
    assert not torch.allclose(gpt(tokens)[:, 6:], gpt(changed)[:, 6:])
    with pytest.raises(InvalidArgumentError, match=r"sequence length \(13\) exceeds block_size"):
        gpt(torch.zeros(1, 13, dtype=torch.long))


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(UnknownModelError, match="nope") as info:
        models.layer_specs("nope", {})
    for known in ("cnn", "gpt", "mlp"):
        assert known in str(info.value)
    with pytest.raises(UnknownModelError):
        models.build("os.path")


@pytest.mark.parametrize(
    ("name", "args", "pattern"),
    [
        ("mlp", {"hidden": 3}, r"'hidden'.*accepted arguments: in_features, hidden_features"),
        ("mlp", {"num_layers": (1, 2)}, r"'num_layers' has type tuple"),
        ("mlp", {"num_layers": object()}, r"'num_layers' has type object"),
        ("cnn", {"channels": [4, {1: 2}]}, r"'channels\[1\]' has a dict key 1"),
        ("cnn", {"channels": [4, "x"]}, r"channels\[1\] \('x'\) must be a positive integer"),
        ("mlp", {"hidden_features": "big"}, r"hidden_features \('big'\)"),
        ("mlp", {"num_layers": 0}, r"num_layers \(0\)"),
        ("mlp", {"num_layers": True}, r"num_layers \(True\)"),
        ("gpt", {"num_heads": 3}, r"num_heads \(3\) must divide embed_dim \(64\)"),
        ("gpt", {"dropout": 1.5}, r"dropout \(1.5\)"),
        (
            "cnn",
            {"image_size": 6},
            r"image_size \(6\) must be divisible by 2\*\*len\(channels\) \(4\)",
        ),
    ],
)
def test_bad_model_args(name: str, args: dict[str, Any], pattern: str) -> None:
    with pytest.raises(InvalidArgumentError, match=pattern):
        models.layer_specs(name, args)
    with pytest.raises(InvalidArgumentError):
        models.build(name, **args)


def test_check_model_args_depth_and_keys() -> None:
    deep: Any = 1
    for _ in range(8):
        deep = [deep]
    models.check_model_args({"x": deep, "y": {"a": [None, 1.5, True, "s"]}})
    with pytest.raises(InvalidArgumentError, match=r"'x\[0\].*deeper than 8 levels"):
        models.check_model_args({"x": [deep]})
    with pytest.raises(InvalidArgumentError, match=r"names must be strings, got 3 \(int\)"):
        models.check_model_args({3: 1})  # type: ignore[dict-item]


def test_factory_errors_become_invalid_argument(isolated_registry: None) -> None:
    @models.register_model("picky")
    def picky(size: int) -> list[models.LayerSpec]:
        if size > 3:
            raise ValueError(f"size ({size}) too big")
        return [models.LayerSpec(nn.Dropout, p=0.5 * size)] * size

    with pytest.raises(InvalidArgumentError, match=r"missing argument\(s\) 'size'; accepted"):
        models.layer_specs("picky", {})
    with pytest.raises(InvalidArgumentError, match=r"size \(4\) too big"):
        models.layer_specs("picky", {"size": 4})
    with pytest.raises(InvalidArgumentError, match="has no layers"):
        models.layer_specs("picky", {"size": 0})
    with pytest.raises(InvalidArgumentError, match=r"building layer 1 .*Dropout.*1\.5"):
        models.build_layers("picky", {"size": 3}, seed=0, start_layer=1, end_layer=2)
    with pytest.raises(InvalidArgumentError, match="building layer 0"):
        models.describe("picky", {"size": 3})  # the builder's ValueError, on the meta device


@pytest.mark.parametrize("bad", ["os.path", "../x", "a/b", "Mlp", "", "1x", "x" * 65, "a b"])
def test_bad_names_cannot_be_registered(bad: str, isolated_registry: None) -> None:
    with pytest.raises(InvalidArgumentError, match="must match"):
        models.register_model(bad)
    assert bad not in models.known_models()


def test_reregistering_a_name(isolated_registry: None) -> None:
    def one() -> list[models.LayerSpec]:
        return [models.LayerSpec(nn.ReLU)]

    def two() -> list[models.LayerSpec]:
        return [models.LayerSpec(nn.ReLU)]

    assert models.register_model("twice")(one) is one
    assert models.register_model("twice")(one) is one  # same function: allowed
    with pytest.raises(InvalidArgumentError, match="'twice' is already registered"):
        models.register_model("twice")(two)
    with pytest.raises(InvalidArgumentError, match="already registered"):
        models.register_model("mlp")(two)


def test_build_layers_checks_range() -> None:
    args = SMALL_ARGS["mlp"]  # 5 layers
    for start, end in [(-1, 2), (2, 2), (3, 1), (0, 6)]:
        with pytest.raises(InvalidArgumentError, match=rf"\[{start}, {end}\).*num_layers \(5\)"):
            models.build_layers("mlp", args, seed=0, start_layer=start, end_layer=end)


def test_build_layer_moves_to_device() -> None:
    spec = models.layer_specs("mlp", {})[0]
    layer = models.build_layer(spec, seed=0, index=0, device="meta")
    assert all(p.is_meta for p in layer.parameters())
    cpu = models.build_layer(spec, seed=0, index=0, device=torch.device("cpu"))
    full = models.build("mlp", seed=0).state_dict()
    assert torch.equal(cpu.state_dict()["0.weight"], full["0.0.weight"])


def test_import_model_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_registry: None
) -> None:
    module_name = "pipesvc_test_custom_models"
    (tmp_path / f"{module_name}.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            from pipesvc.models import LayerSpec, register_model


            @register_model("tiny-custom")
            def tiny(width: int = 3) -> list[LayerSpec]:
                return [LayerSpec(nn.Linear, width, width), LayerSpec(nn.Tanh)]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    try:
        assert models.import_model_modules([module_name]) == ["tiny-custom"]
        assert models.import_model_modules([module_name]) == []  # already imported
        net = models.build("tiny-custom", seed=0, width=4)
        assert net(torch.randn(2, 4)).shape == (2, 4)
        assert models.describe("tiny-custom", {"width": 4}).parameter_counts == [20, 0]
    finally:
        sys.modules.pop(module_name, None)
    with pytest.raises(InvalidArgumentError, match="'no_such_module_xyz'"):
        models.import_model_modules(["no_such_module_xyz"])


def test_concurrent_builds_are_deterministic() -> None:
    expected = models.build("gpt", seed=11, **SMALL_ARGS["gpt"]).state_dict()
    args = SMALL_ARGS["gpt"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [
            pool.submit(models.build_layers, "gpt", args, seed=s, start_layer=0, end_layer=5)
            for s in (11, 12, 11, 13, 11, 14)
        ]
        results = [f.result() for f in futures]
    for layers in results[::2]:
        state = nn.Sequential(*layers).state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)


INPUTS = {"mlp": ((5, 6), "float32"), "gpt": ((3, 12), "int64"), "cnn": ((2, 2, 8, 8), "float32")}


@pytest.mark.parametrize("name", sorted(SMALL_ARGS))
def test_describe_activation_bytes_match_a_real_forward(name: str) -> None:
    """The meta-device measure is what autograd really keeps for each layer on the CPU; for
    attention it errs high (on meta, scaled_dot_product_attention takes the math path and saves
    the attention weights, where the CPU kernel saves the output and its log-sum-exp)."""
    from pipesvc.models.registry import _saved_bytes

    shape, dtype = INPUTS[name]
    desc = models.describe(name, SMALL_ARGS[name], input_shape=shape, input_dtype=dtype)
    net = models.build(name, seed=0, **SMALL_ARGS[name])
    x = torch.randint(0, 32, shape) if dtype == "int64" else torch.randn(shape, requires_grad=True)
    for info, layer in zip(desc.layers, net, strict=True):
        x, real = _saved_bytes(layer, x)
        # 0 for a layer that saves nothing (Flatten).
        assert real <= info.activation_bytes <= 1.25 * real
    assert sum(info.activation_bytes for info in desc.layers) > 0
    assert models.describe(name, SMALL_ARGS[name]).layers[0].activation_bytes == 0


def test_describe_rejects_inputs_the_model_cannot_take() -> None:
    with pytest.raises(InvalidArgumentError, match=r"layer 0 of 'mlp' does not accept .*\[5, 7\]"):
        models.describe("mlp", SMALL_ARGS["mlp"], input_shape=(5, 7))
    with pytest.raises(InvalidArgumentError, match="input_dtype 'complex64'"):
        models.describe("mlp", SMALL_ARGS["mlp"], input_shape=(5, 6), input_dtype="complex64")
    with pytest.raises(InvalidArgumentError, match="input_shape"):
        models.describe("mlp", SMALL_ARGS["mlp"], input_shape=(0, 6))
