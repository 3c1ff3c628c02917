"""Generation through the pipeline with per-stage key/value caches: greedy tokens equal
``transformers``' ``generate`` on the same weights (left-padded prompts of uneven lengths,
2 and 3 stages), seeded sampling repeats, many sessions at once, caches released and expired."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc
from tests.support.stage_probe import stage_info

VOCAB = 50
FAMILIES = {
    "gen-llama": ("llama", {"num_key_value_heads": 2}),
    "gen-gpt2": ("gpt2", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    # a sliding window shorter than the sequence: its sessions' parts never fuse
    "gen-mistral": ("mistral", {"num_key_value_heads": 2, "sliding_window": 5}),
}
OPTIMIZER = {"name": "adamw", "lr": 1e-2}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, (model_type, extra) in FAMILIES.items():
        torch.manual_seed(1)
        sizes = {
            "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 64,
        }  # fmt: skip
        config = AutoConfig.for_model(model_type, **{**sizes, **extra})
        directory = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        dirs[name] = directory
    return dirs


@pytest.fixture(scope="module")
def cluster(hf_dirs: dict[str, Path]) -> Iterator[pipesvc.LocalCluster]:
    with pipesvc.LocalCluster(
        num_stages=3,
        threads_per_stage=1,
        hf_models=hf_dirs,
        stage_args=["--session-idle-s", "2"],
    ) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: pipesvc.LocalCluster) -> Iterator[pipesvc.Client]:
    with cluster.connect() as client:
        yield client


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompts of 7, 4, 6 and 1 tokens, left-padded to 7 with their mask."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (4, 7), generator=g)
    mask = torch.ones(4, 7, dtype=torch.long)
    for row, length in enumerate([7, 4, 6, 1]):
        mask[row, : 7 - length] = 0
        ids[row, : 7 - length] = 0
    return ids, mask


def reference(directory: Path, weights: dict[str, torch.Tensor]) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(directory)
    model.load_state_dict(weights)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def train_two_steps(job: pipesvc.Job) -> None:
    ids, mask = prompts()
    labels = ids.masked_fill(mask == 0, -100)
    for _ in range(2):
        job.train_step(ids, labels, mask)


@pytest.mark.parametrize(
    ("name", "num_stages", "schedule"),
    [("gen-llama", 2, "1f1b"), ("gen-llama", 3, "gpipe"), ("gen-gpt2", 3, "1f1b"),
     ("gen-gpt2", 2, "gpipe"), ("gen-mistral", 2, "1f1b")],
)  # fmt: skip
def test_greedy_tokens_equal_transformers_generate(
    client: pipesvc.Client, hf_dirs: dict[str, Path], name: str, num_stages: int, schedule: str
) -> None:
    ids, mask = prompts()
    with client.create_job(
        model=name, loss="causal_lm", optimizer=OPTIMIZER, num_stages=num_stages,
        schedule=schedule, num_microbatches=2, checkpoint_every=0,
    ) as job:  # fmt: skip
        train_two_steps(job)  # generation reads the committed weights, between steps
        out = job.generate(ids, 12, attention_mask=mask)
        streamed = torch.stack(list(job.stream(ids, 12, attention_mask=mask)), dim=1)
        weights = job.state_dict()
        infos = [stage_info(s.address) for s in job.plan]
        # Generation steps are runs in the trace: the prompt's two parts share one
        # micro-batch, and so do a decode step's (see [Note: fused decode]), whose runs then
        # take up to 4 steps on the stages (see [Note: decode steps on the stages]): the
        # prompt's run makes the first token, runs of 4, 4 and 3 steps the other 11. The
        # mistral's sliding window does not fuse: its two parts are two micro-batches, a run
        # a step.
        fused = name != "gen-mistral"
        expected = [[0], [0] * 4, [0] * 4, [0] * 3] * 2 if fused else [[0, 1]] * 12 * 2
        timelines = job.timelines(max_runs=len(expected))
    for timeline in timelines:
        forwards = [e for e in timeline.events if e.name == "forward"]
        runs = sorted({e.run_id for e in forwards})
        per_run = [sorted(e.microbatch for e in forwards if e.run_id == r) for r in runs]
        assert per_run == expected
        assert {e.name for e in timeline.events} <= {"forward", "wait", "send"}
    with torch.no_grad():
        expected = reference(hf_dirs[name], weights).generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False
        )
    assert out.dtype == torch.long and out.shape == (4, 19)
    assert torch.equal(out, expected)
    assert torch.equal(streamed, out[:, 7:])
    # Both sessions ended: their caches are gone from every stage.
    assert [(i.sessions, i.cache_bytes) for i in infos] == [(0, 0)] * num_stages


def test_seeded_sampling_repeats_and_the_seed_matters(client: pipesvc.Client) -> None:
    ids, mask = prompts()
    with client.create_job(
        model="gen-llama", loss="causal_lm", num_stages=2, num_microbatches=2,
        checkpoint_every=0,
    ) as job:  # fmt: skip
        options: dict[str, Any] = {"temperature": 1.5, "top_k": 20, "top_p": 0.95}
        first = job.generate(ids, 16, attention_mask=mask, seed=7, **options)
        again = job.generate(ids, 16, attention_mask=mask, seed=7, **options)
        other = job.generate(ids, 16, attention_mask=mask, seed=8, **options)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_concurrent_sessions_each_equal_their_own_run(client: pipesvc.Client) -> None:
    g = torch.Generator().manual_seed(11)
    prompts_ = [torch.randint(1, VOCAB, (1 + i % 3, 3 + i), generator=g) for i in range(8)]
    with client.create_job(
        model="gen-llama", loss="causal_lm", num_stages=3, num_microbatches=2,
        checkpoint_every=0,
    ) as job:  # fmt: skip
        alone = [job.generate(p, 10) for p in prompts_]
        together: list[torch.Tensor | None] = [None] * len(prompts_)

        def run(i: int) -> None:
            together[i] = job.generate(prompts_[i], 10)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts_))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    for i, expected in enumerate(alone):
        assert together[i] is not None and torch.equal(together[i], expected), i


def test_closing_a_stream_frees_its_caches_and_an_idle_session_expires(
    client: pipesvc.Client,
) -> None:
    ids, mask = prompts()
    # One step a run: the server sends a stream's tokens as they are made, whether or not its
    # client reads, so the session must still be making them when the stages are asked; in
    # runs of several steps its 6 tokens are made (and its caches released) sooner.
    with client.create_job(
        model="gen-gpt2", loss="causal_lm", num_stages=2, num_microbatches=2,
        checkpoint_every=0, decode_steps=1,
    ) as job:  # fmt: skip
        expected = job.generate(ids, 6, attention_mask=mask)[:, 7:]
        stream = job.stream(ids, 6, attention_mask=mask)
        first = [next(stream), next(stream)]
        held = [stage_info(s.address) for s in job.plan]
        assert all(i.sessions == 1 and i.cache_bytes > 0 for i in held), held
        # Left idle past the stages' --session-idle-s 2: the caches go, and the session
        # rebuilds them from its tokens on the next step, with the same tokens.
        time.sleep(3)
        assert [stage_info(s.address).sessions for s in job.plan] == [0, 0]
        rest = list(stream)
        assert torch.equal(torch.stack(first + rest, dim=1), expected)
        # Closed halfway: the coordinator releases the session on every stage.
        stream = job.stream(ids, 6, attention_mask=mask)
        next(stream)
        stream.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(stage_info(s.address).sessions == 0 for s in job.plan):
                break
            time.sleep(0.1)
        assert [stage_info(s.address).cache_bytes for s in job.plan] == [0, 0]


def test_bad_generation_requests_are_refused(client: pipesvc.Client) -> None:
    ids, mask = prompts()
    with client.create_job(
        model="gen-llama", loss="causal_lm", num_stages=2, checkpoint_every=0
    ) as job:
        cases = {
            "max_new_tokens": lambda: job.generate(ids, 0),
            "temperature": lambda: job.generate(ids, 3, temperature=-1.0),
            "top_p": lambda: job.generate(ids, 3, temperature=1.0, top_p=1.5),
            "attention_mask of shape": lambda: job.generate(ids, 3, attention_mask=mask[:, 1:]),
            "input_ids of shape": lambda: job.generate(ids[0], 3),
        }
        for message, call in cases.items():
            with pytest.raises(pipesvc.InvalidArgumentError, match=message):
                call()
        assert job.generate(ids, 2, attention_mask=mask).shape == (4, 9)


@pytest.mark.parametrize(("model", "limit"), [("gpt", 32), ("gen-gpt2", 64)])
def test_a_length_past_the_models_positions_is_refused_before_any_token(
    client: pipesvc.Client, model: str, limit: int
) -> None:
    # The built-in gpt's block_size and a Hugging Face config's max_position_embeddings bound
    # the prompt and its new tokens together; without the check the session streamed tokens
    # until the first position past the table, then failed.
    args = {"vocab_size": VOCAB, "block_size": limit, "embed_dim": 32, "num_blocks": 2}
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    with client.create_job(
        model=model, model_args=args if model == "gpt" else {}, num_stages=2, optimizer=None
    ) as job:
        stream = job.stream(ids, limit - 6)
        with pytest.raises(pipesvc.InvalidArgumentError) as refused:
            next(stream)  # the first read: no token came before the refusal
        with pytest.raises(pipesvc.InvalidArgumentError):
            job.generate(ids, limit - 6)
        fits = job.generate(ids, limit - 7)  # exactly every position: runs to the end
    message = str(refused.value)
    assert f"7 tokens + max_new_tokens {limit - 6}" in message, message
    assert f"maximum of {limit}" in message, message
    assert fits.shape == (2, limit)


def test_the_builtin_gpt_generates_through_its_caches_like_one_process(
    client: pipesvc.Client,
) -> None:
    args = {"vocab_size": 40, "block_size": 32, "embed_dim": 32, "num_heads": 4, "num_blocks": 3}
    ids = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(2))
    with client.create_job(
        model="gpt", model_args=args, seed=3, num_stages=3, num_microbatches=2,
        checkpoint_every=0,
    ) as job:  # fmt: skip
        out = job.generate(ids, 10)
        stream = job.stream(ids, 10)
        next(stream)
        cached = [stage_info(s.address).cache_bytes for s in job.plan]
        stream.close()
        weights = job.state_dict()
        # A left-padded row generates what its unpadded prompt generates alone.
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        padded = job.generate(ids, 4, attention_mask=mask)
        alone = job.generate(ids[:1, 2:], 4)
    # The embedding (stage 0) and the head (stage 2) hold no cache; each block's stage does.
    assert cached[1] > 0
    model = pipesvc.models.build("gpt", seed=3, **args)
    model.load_state_dict(weights)
    model.eval()
    tokens = ids
    with torch.no_grad():
        for _ in range(10):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens)
    assert torch.equal(padded[0, 5:], alone[0, 3:])


def test_an_inference_job_holds_weights_only_and_generates(
    client: pipesvc.Client, hf_dirs: dict[str, Path]
) -> None:
    ids, mask = prompts()
    with client.create_job(model="gen-llama", optimizer=None, num_stages=2) as job:
        out = job.generate(ids, 5, attention_mask=mask)
        with pytest.raises(pipesvc.FailedPreconditionError, match="inference job"):
            job.train_step(ids, ids)
        assert job.step == 0 and job.gradients() == {}
        infos = [stage_info(s.address) for s in job.plan]
        weights = job.state_dict()
    with torch.no_grad():
        expected = reference(hf_dirs["gen-llama"], weights).generate(
            ids, attention_mask=mask, max_new_tokens=5, do_sample=False
        )
    assert torch.equal(out, expected)
    assert sum(i.num_parameters for i in infos) > 0
    # The default is an explicit optimizer, not what None means.
    with client.create_job(model="gen-llama", num_stages=2) as training:
        train_two_steps(training)
        assert training.step == 2
    assert training.config.optimizer == {"name": "adamw", "lr": 1e-3}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_generation_runs_in_the_jobs_precision(
    client: pipesvc.Client, hf_dirs: dict[str, Path], precision: str
) -> None:
    # Under bfloat16 the tokens are the one-process model's under the same casts; they may part
    # from float32's after a near tie, so this checks the run, the shapes and determinism.
    ids, mask = prompts()
    with client.create_job(
        model="gen-llama", optimizer=None, num_stages=2, num_microbatches=2, precision=precision
    ) as job:
        first = job.generate(ids, 6, attention_mask=mask)
        again = job.generate(ids, 6, attention_mask=mask)
    assert first.shape == (4, 13) and torch.equal(first, again)
    assert torch.equal(first[:, :7], ids)


def test_rows_that_produce_the_end_token_finish_like_transformers(
    client: pipesvc.Client, hf_dirs: dict[str, Path]
) -> None:
    ids, mask = prompts()
    with client.create_job(model="gen-gpt2", optimizer=None, num_stages=2) as job:
        free = job.generate(ids, 10, attention_mask=mask)
        eos = int(free[1, 9])  # a token row 1 produces third: it finishes there
        out = job.generate(ids, 10, attention_mask=mask, eos_token_id=eos)
        weights = job.state_dict()
    model = reference(hf_dirs["gen-gpt2"], weights)
    with torch.no_grad():
        expected = model.generate(
            ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos,
            pad_token_id=eos,
        )  # fmt: skip
    assert torch.equal(out, expected)
    assert out[1, 9:].eq(eos).all()


def test_training_and_a_session_on_one_job_take_turns(client: pipesvc.Client) -> None:
    # Each generation step holds the job for one run and each training step for one step, so
    # neither waits for the other to finish: both make progress in turns.
    ids, mask = prompts()
    labels = ids.masked_fill(mask == 0, -100)
    with client.create_job(
        model="gen-llama", loss="causal_lm", optimizer=OPTIMIZER, num_stages=2,
        num_microbatches=2, checkpoint_every=0,
    ) as job:  # fmt: skip
        events: list[tuple[str, float]] = []
        trainer_done = threading.Event()

        def train() -> None:
            for _ in range(8):
                job.train_step(ids, labels, mask)
                events.append(("train", time.monotonic()))
            trainer_done.set()

        trainer = threading.Thread(target=train)
        trainer.start()
        for _ in job.stream(ids, 30, attention_mask=mask):
            events.append(("token", time.monotonic()))
        trainer.join(timeout=120)
        assert trainer_done.is_set() and job.step == 8
    kinds = [kind for kind, _ in sorted(events, key=lambda e: e[1])]
    # Tokens came while training was still going, and steps while tokens were still coming.
    first_train, last_train = kinds.index("train"), len(kinds) - 1 - kinds[::-1].index("train")
    assert "token" in kinds[first_train:last_train]
    first_token = kinds.index("token")
    last_token = len(kinds) - 1 - kinds[::-1].index("token")
    assert "train" in kinds[first_token:last_token]
