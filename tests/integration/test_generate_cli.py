"""``pipesvc generate``: a job's text streamed to the terminal through its own tokenizer (a
Hugging Face model's tokenizer.json, read from its directory) or the demo's characters."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from pipesvc.demo import CharCorpus

WORDS = [f"w{i}" for i in range(48)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(3)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("wordy")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[pipesvc.LocalCluster]:
    with pipesvc.LocalCluster(num_stages=2, hf_models={"wordy": model_dir}) as cluster:
        yield cluster


def generate_cli(cluster: pipesvc.LocalCluster, job: pipesvc.Job, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pipesvc", "generate", "--coordinator", cluster.address,
         "--job", job.id, *args],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return done.stdout


def test_generate_streams_a_hugging_face_models_text_with_its_tokenizer(
    cluster: pipesvc.LocalCluster,
) -> None:
    with cluster.connect() as client, client.create_job(model="wordy", optimizer=None) as job:
        out = generate_cli(cluster, job, "--prompt", "w5 w7 w9", "--max-new-tokens", "6")
        ids = job.generate(torch.tensor([[5, 7, 9]]), 6)[0].tolist()
    assert out == " ".join(WORDS[i] for i in ids) + "\n"


def test_generate_uses_the_demos_characters_for_the_builtin_gpt(
    cluster: pipesvc.LocalCluster,
) -> None:
    corpus = CharCorpus.from_python_docs()
    args = {"vocab_size": corpus.vocab_size, "block_size": 32, "embed_dim": 32, "num_blocks": 2}
    with (
        cluster.connect() as client,
        client.create_job(model="gpt", model_args=args, optimizer=None) as job,
    ):
        out = generate_cli(
            cluster, job, "--prompt", "def f", "--max-new-tokens", "9", "--temperature", "0.9",
            "--seed", "4",
        )  # fmt: skip
        prompt = torch.tensor([corpus.encode("def f")])
        ids = job.generate(prompt, 9, temperature=0.9, seed=4)[0].tolist()
    # A model no tokenizer is known for is refused with what to do.
    with cluster.connect() as client, client.create_job(model="mlp", optimizer=None) as other:
        refused = subprocess.run(
            [sys.executable, "-m", "pipesvc", "generate", "--coordinator", cluster.address,
             "--job", other.id, "--prompt", "x"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out == corpus.decode(ids) + "\n"
    assert refused.returncode != 0 and "--tokenizer" in refused.stderr


def test_a_gpt_job_made_on_the_command_line_generates_with_the_demos_vocabulary(
    cluster: pipesvc.LocalCluster,
) -> None:
    def pipesvc_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pipesvc", *args, "--coordinator", cluster.address],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    count = CharCorpus.from_python_docs().vocab_size
    # One stage each: the cluster's two stages hold both jobs at once.
    create = ["job", "create", "--model", "gpt", "--model-arg", "block_size=32", "--stages", "1"]
    made = [
        pipesvc_cli(*create, "--inference"),  # the gpt's own vocab_size, 128
        pipesvc_cli(*create, "--inference", "--model-arg", f"vocab_size={count}"),
    ]
    assert [m.returncode for m in made] == [0, 0], made
    default, fits = (m.stdout.strip() for m in made)
    generate = ["generate", "--prompt", "def f", "--max-new-tokens", "5"]
    refused = pipesvc_cli(*generate, "--job", default)
    out = pipesvc_cli(*generate, "--job", fits)
    for job in (default, fits):
        assert pipesvc_cli("job", "close", job).returncode == 0
    # The rule is in the refusal: which vocab_size, and how to create such a job.
    assert refused.returncode == 2, refused
    assert f"vocab_size={count}" in refused.stderr and "vocab_size 128" in refused.stderr
    assert "--model-arg" in refused.stderr
    assert out.returncode == 0 and out.stdout.startswith("def f") and len(out.stdout) == 11, out
    bad = pipesvc_cli("job", "create", "--model", "gpt", "--model-arg", "vocab_size")
    assert bad.returncode == 2 and "'vocab_size' is not KEY=VALUE" in bad.stderr


def test_job_create_takes_the_wire_codec_and_the_prefill_chunk(
    cluster: pipesvc.LocalCluster,
) -> None:
    def create(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pipesvc", "job", "create", "--model", "wordy",
             "--inference", "--stages", "2", *args, "--coordinator", cluster.address],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    made = create("--wire-dtype", "activations=int8,gradients=bfloat16", "--prefill-chunk", "0")
    assert made.returncode == 0, made
    with cluster.connect() as client:
        job = client.get_job(made.stdout.strip())
        assert job.config.wire_dtype == "activations=int8,gradients=bfloat16"
        assert job.config.prefill_chunk == 0
        job.close()
    # The stages share a host: the link stays exact, and the plan says so.
    assert "rank 0 -> 1: on one host, activations exact, gradients exact" in made.stderr
    bad = create("--wire-dtype", "int3")
    assert bad.returncode == 2 and "'int3'" in bad.stderr, bad
