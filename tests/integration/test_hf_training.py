"""Hugging Face models trained through real stage processes equal transformers' model trained
in one process: causal-LM loss over padded batches split unevenly, AdamW, both schedules."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.core.loss import IGNORE_INDEX
from pipesvc.storage.checkpoint import read_layers, read_manifest

VOCAB = 48
FAMILIES = {
    # grouped-query attention
    "hf-llama": ("llama", {"num_key_value_heads": 2}),
    # a head stored under an older name, biases, parallel attention and MLP
    "hf-neox": ("gpt_neox", {}),
    # one block: over three stages each layer is a stage, and with LoRA the first (the
    # embedding) has nothing to train
    "hf-tiny": ("llama", {"num_key_value_heads": 2, "num_hidden_layers": 1}),
    # the head tied to the input embedding (GPT-2's default), learned positions; no dropout
    "hf-gpt2": ("gpt2", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    # a sliding window shorter than the sequence: the mask is built as mistral builds it
    "hf-mistral": ("mistral", {"num_key_value_heads": 2, "sliding_window": 4}),
    # multi-query attention
    "hf-qwen2": ("qwen2", {"num_key_value_heads": 1}),
    # a scaled embedding, multi-query attention, the head tied to the embedding
    "hf-gemma": ("gemma", {"num_key_value_heads": 1, "head_dim": 8}),
    # partial rotary embeddings, a dense head with a bias
    "hf-phi": ("phi", {}),
}
STORED_BF16 = {
    # what a published checkpoint looks like: stored in bfloat16 (its config says so), sharded
    "hf-llama-bf16": "hf-llama",
    "hf-gpt2-bf16": "hf-gpt2",
}
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}
# eps 1e-6, not 1e-8: a key bias's gradient is zero in exact arithmetic (softmax ignores a
# shift shared by all keys), so in floating point it is rounding noise of ~1e-10, which Adam
# with eps 1e-8 turns into updates of up to lr whose sign depends on the order of sums.
STEPS = 3


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, (model_type, extra) in FAMILIES.items():
        torch.manual_seed(0)
        sizes = {
            "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 32,
        }  # fmt: skip
        config = AutoConfig.for_model(model_type, **{**sizes, **extra})
        directory = tmp_path_factory.mktemp(name)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(directory, max_shard_size="30KB")
        dirs[name] = directory
        for stored, source in STORED_BF16.items():
            if source == name:
                dirs[stored] = tmp_path_factory.mktemp(stored)
                model.to(torch.bfloat16).save_pretrained(dirs[stored], max_shard_size="30KB")
    return dirs


@pytest.fixture(scope="module")
def hf_client(hf_dirs: dict[str, Path]) -> Iterator[pipesvc.Client]:
    with (
        pipesvc.LocalCluster(num_stages=4, threads_per_stage=1, hf_models=hf_dirs) as cluster,
        pipesvc.connect(cluster.address, timeout_s=120) as client,
    ):
        yield client


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """7 rows of 10 tokens; rows padded unevenly at the end (labels -100 there)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (7, 10), generator=g)
    labels = ids.clone()
    for row in range(7):
        labels[row, 10 - (row * (step + 1)) % 7 :] = IGNORE_INDEX
    return ids, labels


def train_in_one_process(model: Any, clip: float | None = None) -> list[float]:
    """``STEPS`` AdamW steps (``OPTIMIZER``) of ``model`` on ``batch``, over the parameters
    that require gradients, clipping their global norm to ``clip``; returns the losses."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)
    losses = []
    for step in range(STEPS):
        ids, labels = batch(step)
        optimizer.zero_grad()
        loss = model(ids, labels=labels).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        losses.append(loss.item())
    return losses


def reference_run(directory: Path) -> tuple[list[float], Any]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return train_in_one_process(model), model


@pytest.mark.parametrize(
    ("name", "schedule", "num_stages"),
    [("hf-llama", "1f1b", 3), ("hf-llama", "gpipe", 2), ("hf-neox", "gpipe", 3),
     ("hf-neox", "1f1b", 2), ("hf-qwen2", "gpipe", 3), ("hf-gemma", "1f1b", 2),
     ("hf-phi", "1f1b", 3), ("hf-mistral", "gpipe", 2), ("hf-llama", "zb-h1", 3)],
)  # fmt: skip
def test_training_equals_transformers_in_one_process(
    hf_client: pipesvc.Client, hf_dirs: dict[str, Path], name: str, schedule: str, num_stages: int
) -> None:
    job = hf_client.create_job(
        model=name,
        loss="causal_lm",
        optimizer=OPTIMIZER,
        schedule=schedule,
        num_stages=num_stages,
        num_microbatches=3,
        input_shape=[3, 10],
        input_dtype="int64",
        checkpoint_every=2,
    )
    try:
        losses = [job.train_step(*batch(step)) for step in range(STEPS)]
        expected_losses, reference = reference_run(hf_dirs[name])
        assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
        ids, _ = batch(99)
        reference.eval()
        with torch.no_grad():
            expected_logits = reference(ids).logits
        assert torch.allclose(job.forward(ids), expected_logits, rtol=1e-4, atol=1e-5)
        weights = job.state_dict()  # the Hugging Face model's own keys
        expected = reference.state_dict()
        assert sorted(weights) == sorted(expected)
        for key, value in weights.items():
            assert torch.allclose(value, expected[key], rtol=1e-4, atol=1e-5), key
    finally:
        job.close()


@pytest.mark.parametrize(
    ("name", "precision", "schedule"),
    [("hf-llama-bf16", "fp32", "1f1b"), ("hf-gpt2-bf16", "fp32", "gpipe"),
     ("hf-llama-bf16", "bf16-mixed", "1f1b"), ("hf-llama-bf16", "bf16", "gpipe")],
)  # fmt: skip
def test_a_bfloat16_checkpoint_trains_in_the_jobs_precision(
    hf_client: pipesvc.Client,
    hf_dirs: dict[str, Path],
    name: str,
    precision: str,
    schedule: str,
    tmp_path: Path,
) -> None:
    # The files (sharded) and the config say bfloat16, as a published checkpoint's do. fp32 and
    # bf16-mixed train float32 weights, gradients and AdamW state, as transformers loaded with
    # dtype=float32 from the same directory does; only bf16 keeps them bfloat16.
    directory = hf_dirs[name]
    assert AutoConfig.from_pretrained(directory).dtype == torch.bfloat16
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    with hf_client.create_job(
        model=name, loss="causal_lm", optimizer=OPTIMIZER, precision=precision,
        schedule=schedule, num_stages=2, num_microbatches=3, checkpoint_every=0,
    ) as job:  # fmt: skip
        initial = job.state_dict()
        losses = [job.train_step(*batch(step)) for step in range(2)]
        weights, gradients = job.state_dict(), job.gradients()
        job.save(tmp_path / "ckpt")
        job.save_pretrained(tmp_path / "as-stored", max_shard_size="30KB")
        job.save_pretrained(tmp_path / "float32", dtype=torch.float32)
        ids, _ = batch(99)
        logits = job.forward(ids)
    # save_pretrained writes the dtype the checkpoint came in, unless told otherwise.
    for saved, dtype in (("as-stored", torch.bfloat16), ("float32", torch.float32)):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / saved)  # dtype "auto"
        assert {p.dtype for p in loaded.parameters()} == {dtype}, saved
        for key, value in loaded.state_dict().items():
            assert torch.equal(value, weights[key].to(dtype)), key
    if precision == "fp32":
        with torch.no_grad():
            assert torch.allclose(loaded.eval()(ids).logits, logits, rtol=1e-5, atol=1e-6)
    manifest = read_manifest(tmp_path / "ckpt")
    state = dict(read_layers(tmp_path / "ckpt", manifest, 0, manifest.num_layers))
    moments = {k: v for k, v in state.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}
    assert len(moments) == 2 * len(weights)  # both moments of each (each tied copy too)
    for kind, tensors in (("weights", weights), ("gradients", gradients), ("AdamW", moments)):
        assert {str(t.dtype) for t in tensors.values()} == {str(want)}, kind
    reference: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    for key, value in reference.state_dict().items():
        assert torch.equal(initial[key], value.to(want)), key  # bfloat16 values, exactly
    if precision != "fp32":
        expected_losses, _ = reference_run(directory)
        assert losses[0] == pytest.approx(expected_losses[0], rel=1e-2)
        return
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    expected_losses = []
    for step in range(2):
        optimizer.zero_grad()
        loss = reference(*batch(step)[:1], labels=batch(step)[1]).loss
        loss.backward()
        optimizer.step()
        expected_losses.append(loss.item())
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    expected = reference.state_dict()
    for key, value in weights.items():
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=1e-5), key
    for key, param in reference.named_parameters():
        assert torch.allclose(gradients[key], param.grad, rtol=1e-4, atol=1e-6), key


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize(
    ("name", "schedule", "partition"),
    [("hf-llama", "1f1b", "parameters"), ("hf-llama", "gpipe", "parameters"),
     ("hf-tiny", "1f1b", "uniform"), ("hf-tiny", "zb-h1", "uniform")],
)  # fmt: skip
def test_lora_training_equals_peft_in_one_process(
    hf_client: pipesvc.Client, hf_dirs: dict[str, Path], name: str, schedule: str, partition: str
) -> None:
    from peft import LoraConfig, get_peft_model

    blocks = AutoConfig.from_pretrained(hf_dirs[name]).num_hidden_layers
    job = hf_client.create_job(
        model=name,
        partition=partition,
        model_args={"lora": LORA},
        loss="causal_lm",
        optimizer=OPTIMIZER,
        schedule=schedule,
        num_stages=3,
        num_microbatches=3,
        input_shape=[3, 10],
        input_dtype="int64",
        checkpoint_every=2,
    )
    try:
        initial = job.state_dict()
        losses = [job.train_step(*batch(step)) for step in range(STEPS)]
        final = job.state_dict()
    finally:
        job.close()
    reference = get_peft_model(
        AutoModelForCausalLM.from_pretrained(hf_dirs[name]),
        LoraConfig(**LORA),  # type: ignore[arg-type]
    )
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, value in initial.items():
            params[f"base_model.model.{name}"].copy_(value)
    expected_losses = train_in_one_process(reference)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    changed = 0
    for name, value in final.items():
        expected = params[f"base_model.model.{name}"]
        assert torch.allclose(value, expected, rtol=1e-4, atol=1e-5), name
        if "lora_" in name:
            changed += not torch.equal(value, initial[name])
        else:
            assert torch.equal(value, initial[name]), name  # frozen
    assert changed == 4 * blocks  # lora_A and lora_B of q_proj and v_proj, in each block


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", ["hf-llama", "hf-neox"])
def test_save_pretrained_loads_in_transformers_with_the_jobs_logits(
    hf_client: pipesvc.Client, hf_dirs: dict[str, Path], name: str, tmp_path: Path
) -> None:
    from peft import PeftModel

    ids, _ = batch(50)
    options = {
        "model": name, "loss": "causal_lm", "optimizer": OPTIMIZER, "num_stages": 3,
        "num_microbatches": 3, "checkpoint_every": 0,
    }  # fmt: skip
    with hf_client.create_job(**options) as job:  # type: ignore[arg-type]
        for step in range(2):
            job.train_step(*batch(step))
        job.save_pretrained(tmp_path / "full", max_shard_size="40KB")
        expected = job.forward(ids)
    assert (tmp_path / "full" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
        assert torch.allclose(loaded(ids).logits, expected, rtol=1e-5, atol=1e-6)
    if name != "hf-llama":
        return
    with hf_client.create_job(**options, model_args={"lora": LORA}) as job:  # type: ignore[arg-type]
        for step in range(2):
            job.train_step(*batch(step))
        job.save_pretrained(tmp_path / "adapter")
        job.save_pretrained(tmp_path / "merged", merged=True)
        expected = job.forward(ids)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(hf_dirs[name])
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        assert torch.allclose(adapted(ids).logits, expected, rtol=1e-5, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert torch.allclose(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_saving_a_job_deletes_no_file_it_did_not_write(
    hf_client: pipesvc.Client, hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    # Both saves into a directory of the user's, beside a sibling named like a temporary one:
    # the user's files stay, pipesvc's own are replaced (a smaller save leaves no stale shard),
    # and a target that is a file is refused before anything is read or written.
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (tmp_path / "out.tmp").write_text("mine too")
    ids, _ = batch(7)
    with hf_client.create_job(
        model="hf-llama", loss="causal_lm", optimizer=OPTIMIZER, num_stages=2, checkpoint_every=0
    ) as job:  # fmt: skip
        job.save_pretrained(target, max_shard_size="20KB")
        job.save(target)
        job.train_step(*batch(0))
        job.save_pretrained(target, max_shard_size="60KB")
        job.save(target)
        logits, step = job.forward(ids), job.step
        for call in (job.save, job.save_pretrained):
            with pytest.raises(pipesvc.InvalidArgumentError, match=r"out\.tmp'.*not a directory"):
                call(tmp_path / "out.tmp")
    assert (target / "notes.txt").read_text() == "mine"
    assert (tmp_path / "out.tmp").read_text() == "mine too"
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = {p.name for p in target.glob("model-*.safetensors")}
    assert shards == set(index["weight_map"].values())  # none of the first save's left
    loaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, logits, rtol=1e-5, atol=1e-6)
    assert read_manifest(target).step == step == 1


def test_save_pretrained_of_a_model_of_our_own_is_refused(
    hf_client: pipesvc.Client, tmp_path: Path
) -> None:
    with hf_client.create_job(model="mlp", loss="mse") as job:
        assert job.model_export() is None
        with pytest.raises(pipesvc.FailedPreconditionError, match="not a Hugging Face model"):
            job.save_pretrained(tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_a_saved_hf_job_resumes_with_its_lora_adapters(
    hf_client: pipesvc.Client, tmp_path: Path
) -> None:
    options = {
        "model": "hf-llama", "model_args": {"lora": LORA}, "loss": "causal_lm",
        "optimizer": OPTIMIZER, "num_stages": 2, "num_microbatches": 3, "checkpoint_every": 0,
    }  # fmt: skip
    with hf_client.create_job(**options) as job:  # type: ignore[arg-type]
        job.train_step(*batch(0))
        job.save(tmp_path / "ckpt")
        expected = job.train_step(*batch(1))
        expected_state = job.state_dict()
    with hf_client.create_job(**options, resume_from=tmp_path / "ckpt") as again:  # type: ignore[arg-type]
        assert again.step == 1
        assert again.train_step(*batch(1)) == expected
        state = again.state_dict()
    assert sorted(state) == sorted(expected_state)
    assert all(torch.equal(state[k], expected_state[k]) for k in state)


def test_trainable_patterns_freeze_the_rest_like_one_process(
    hf_client: pipesvc.Client, hf_dirs: dict[str, Path]
) -> None:
    trainable = ["model.layers.*.mlp.*", "model.norm.*"]
    with hf_client.create_job(
        model="hf-llama", loss="causal_lm", optimizer=OPTIMIZER, num_stages=3,
        num_microbatches=3, checkpoint_every=2, trainable=trainable,
    ) as job:  # fmt: skip
        initial = job.state_dict()
        losses = [job.train_step(*batch(step)) for step in range(STEPS)]
        final = job.state_dict()
        gradients = job.gradients()
    reference = AutoModelForCausalLM.from_pretrained(hf_dirs["hf-llama"])
    for name, param in reference.named_parameters():
        param.requires_grad_(any(fnmatch.fnmatchcase(name, p) for p in trainable))
    expected_losses = train_in_one_process(reference)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    expected = reference.state_dict()
    trains = {n for n, p in reference.named_parameters() if p.requires_grad}
    assert trains and sorted(gradients) == sorted(trains)  # no gradient for frozen weights
    for key, value in final.items():
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=1e-5), key
        assert torch.equal(value, initial[key]) == (key not in trains), key


@pytest.mark.parametrize(
    ("schedule", "num_stages", "clip", "replicas"),
    [
        ("1f1b", 3, None, 1),
        ("gpipe", 2, 0.5, 1),
        ("1f1b", 1, 0.5, 1),
        ("zb-h1", 1, None, 1),
        ("zb-h1", 2, 0.5, 1),
        ("1f1b", 2, 0.5, 2),  # each replica swaps its tied gradients, then the replicas sum
    ],
)
def test_a_tied_embedding_and_head_train_as_one_parameter(
    hf_client: pipesvc.Client,
    hf_dirs: dict[str, Path],
    schedule: str,
    num_stages: int,
    clip: float | None,
    replicas: int,
    tmp_path: Path,
) -> None:
    # GPT-2 uses its token embedding as the LM head. Over 2 or 3 stages the embedding (first
    # stage) and the head (last) are copies on different stages, on 1 stage two copies on one:
    # both get the sum of both gradients and the same update, so they stay bit-identical and
    # training equals the tied model in one process, norm clipping (a tied weight counts once)
    # included.
    job = hf_client.create_job(
        model="hf-gpt2",
        loss="causal_lm",
        optimizer=OPTIMIZER,
        schedule=schedule,
        num_stages=num_stages,
        data_parallel=replicas,
        num_microbatches=3,
        clip_grad_norm=clip,
        checkpoint_every=2,
    )
    with job:
        losses = [job.train_step(*batch(step)) for step in range(STEPS)]
        weights, gradients = job.state_dict(), job.gradients()
        job.save_pretrained(tmp_path / "saved")
        ids, _ = batch(99)
        logits = job.forward(ids)
    embed, head = "transformer.wte.weight", "lm_head.weight"
    assert torch.equal(gradients[embed], gradients[head])
    assert torch.equal(weights[embed], weights[head])
    reference = AutoModelForCausalLM.from_pretrained(hf_dirs["hf-gpt2"])
    assert reference.lm_head.weight is reference.transformer.wte.weight
    expected_losses = train_in_one_process(reference, clip)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    expected = reference.state_dict()
    assert sorted(weights) == sorted(expected)
    for key, value in weights.items():
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=1e-5), key
    # The copies are equal, so the saved model is tied again, with the job's logits.
    assert AutoConfig.from_pretrained(tmp_path / "saved").tie_word_embeddings is True
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
        assert torch.allclose(loaded(ids).logits, logits, rtol=1e-5, atol=1e-6)


def left_padded(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """7 rows of up to 10 tokens, left-padded to different lengths (one row not at all), with
    their attention mask; labels -100 on the padding."""
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (7, 10), generator=g)
    mask = torch.ones(7, 10, dtype=torch.long)
    for row in range(1, 7):
        mask[row, : (row * (step + 2)) % 8] = 0
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return ids, labels, mask


@pytest.mark.parametrize(
    ("name", "schedule", "num_stages"),
    [("hf-llama", "1f1b", 3), ("hf-gpt2", "gpipe", 2), ("hf-mistral", "1f1b", 2),
     ("hf-neox", "gpipe", 3)],
)  # fmt: skip
def test_padded_batches_with_an_attention_mask_equal_one_process(
    hf_client: pipesvc.Client, hf_dirs: dict[str, Path], name: str, schedule: str, num_stages: int
) -> None:
    # Left padding changes what every real token attends to, so it only matches with the
    # mask: it reaches every block on every stage, split with the micro-batches (3 uneven ones).
    with hf_client.create_job(
        model=name, loss="causal_lm", optimizer=OPTIMIZER, schedule=schedule,
        num_stages=num_stages, num_microbatches=3, checkpoint_every=2,
    ) as job:  # fmt: skip
        losses = [job.train_step(*left_padded(step)) for step in range(STEPS)]
        weights, gradients = job.state_dict(), job.gradients()
        ids, _, mask = left_padded(99)
        logits = job.forward(ids, attention_mask=mask)
        unmasked = job.forward(ids)
    reference: Any = AutoModelForCausalLM.from_pretrained(hf_dirs[name])
    reference.train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    expected_losses = []
    for step in range(STEPS):
        step_ids, labels, step_mask = left_padded(step)
        optimizer.zero_grad()
        loss = reference(step_ids, attention_mask=step_mask, labels=labels).loss
        loss.backward()
        expected_grads = {k: p.grad.clone() for k, p in reference.named_parameters()}
        optimizer.step()
        expected_losses.append(loss.item())
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    expected = reference.state_dict()
    for key, value in weights.items():
        assert torch.allclose(value, expected[key], rtol=1e-4, atol=1e-5), key
    for key, grad in expected_grads.items():
        assert torch.allclose(gradients[key], grad, rtol=1e-4, atol=1e-6), key
    reference.eval()
    with torch.no_grad():
        expected_logits = reference(ids, attention_mask=mask).logits
        expected_unmasked = reference(ids).logits
    real = mask.bool()  # padded positions' logits are not defined by a mask (rows of pads)
    assert torch.allclose(logits[real], expected_logits[real], rtol=1e-4, atol=1e-5)
    assert torch.allclose(unmasked, expected_unmasked, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(logits[real], unmasked[real], rtol=1e-4, atol=1e-5)


def test_a_mask_that_does_not_fit_is_refused_and_changes_nothing(
    hf_client: pipesvc.Client,
) -> None:
    with hf_client.create_job(
        model="hf-llama", loss="causal_lm", optimizer=OPTIMIZER, num_stages=2,
        num_microbatches=3, checkpoint_every=0,
    ) as job:  # fmt: skip
        ids, labels, mask = left_padded(0)
        before = job.state_dict()
        bad = {
            r"shape \[7, 9\]": mask[:, :9],
            "dtype torch.float32": mask.float(),
            "only 0 and 1": mask * 2,
        }
        for message, wrong in bad.items():
            with pytest.raises(pipesvc.InvalidArgumentError, match=message):
                job.train_step(ids, labels, wrong)
            with pytest.raises(pipesvc.InvalidArgumentError, match=message):
                job.forward(ids, attention_mask=wrong)
        assert job.refresh().step == 0
        after = job.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)
        job.train_step(ids, labels, mask)  # the job still trains
        assert job.step == 1
