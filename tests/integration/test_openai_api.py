"""The coordinator's OpenAI-compatible API, through the official ``openai`` package, against a
real coordinator and stages: a small Llama saved with a word tokenizer and a chat template.
Greedy output through the API is ``job.generate``'s on the same prompt; a client that goes
away mid-stream leaves no session and no cache on any stage."""

from __future__ import annotations

import http.client
import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoModelForCausalLM

import pipesvc
from pipesvc.core.tensor_codec import encode
from pipesvc.errors import InvalidArgumentError
from pipesvc.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.support.chat_model import EOS, TEMPLATE, WORDS, api_url, save_chat_model
from tests.support.metrics import coordinator_metric

Served = tuple[str, pipesvc.Job, pipesvc.Job]
"""The API's base URL, the job named "my-llama", and an unnamed job."""
TOKEN = "s3cret-api-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A 3-stage cluster with a token serving the API: "my-llama" on 2 stages (with a chat
    template), and an unnamed job of a model without one on the third; the API's base URL."""
    folder = tmp_path_factory.mktemp("openai")
    chat = save_chat_model(folder / "chat", chat_template=TEMPLATE)
    plain = save_chat_model(folder / "plain", chat_template=None)
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    with (
        pipesvc.LocalCluster(
            num_stages=3,
            hf_models={"wordy": chat, "plainwords": plain},
            token_file=token_file,
            coordinator_args=["--http-port", "0"],
        ) as cluster,
        pipesvc.connect(cluster.address, token=TOKEN) as client,
        client.create_job(model="wordy", optimizer=None, num_stages=2, name="my-llama") as job,
        client.create_job(model="plainwords", optimizer=None, num_stages=1) as unnamed,
    ):
        url = api_url(cluster)
        yield url, job, unnamed


def served_dir(job: pipesvc.Job) -> str:
    export = job.model_export()
    assert export is not None
    return str(export["source"])


def _client(url: str, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=token, max_retries=0, timeout=60)


def _ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def _greedy(job: pipesvc.Job, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``job.generate``'s new tokens, up to the end-of-sequence token."""
    out = job.generate(torch.tensor([prompt]), max_new_tokens)[0, len(prompt) :].tolist()
    return out[: out.index(EOS)] if EOS in out else out


def _text(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def test_models_lists_names_and_the_ids_of_unnamed_jobs(
    served: Served,
) -> None:
    url, job, unnamed = served
    assert job.config.name == "my-llama" and unnamed.config.name is None
    listed = [m.id for m in _client(url).models.list()]
    assert listed == ["my-llama", unnamed.id]


def test_greedy_completions_equal_job_generate_whole_and_streamed(
    served: Served,
) -> None:
    url, job, unnamed = served
    api = _client(url)
    prompt = "w3 w17 w5 w9"
    expected = _greedy(job, _ids(prompt), 12)
    reply = api.completions.create(model="my-llama", prompt=prompt, max_tokens=12, temperature=0)
    (choice,) = reply.choices
    assert choice.text == _text(expected)
    assert choice.finish_reason == ("length" if len(expected) == 12 else "stop")
    assert reply.object == "text_completion" and reply.model == "my-llama"
    assert reply.usage is not None and reply.usage.prompt_tokens == 4
    assert reply.usage.completion_tokens == min(len(expected) + 1, 12)
    # Token ids as the prompt, and the job's id as the model, give the same.
    by_ids = api.completions.create(model=job.id, prompt=_ids(prompt), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == choice.text
    chunks = list(
        api.completions.create(
            model="my-llama", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    # And transformers' own greedy generate in one process.
    model = AutoModelForCausalLM.from_pretrained(served_dir(job))
    ids = torch.tensor([_ids(prompt)])
    own = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=EOS)
    assert _text([t for t in own[0, 4:].tolist() if t != EOS]) == choice.text
    # A model without a chat template still completes text (the unnamed job, by its id).
    other = api.completions.create(model=unnamed.id, prompt=prompt, max_tokens=5, temperature=0)
    assert other.choices[0].text == _text(_greedy(unnamed, _ids(prompt), 5))


def test_chat_goes_through_the_chat_template(
    served: Served,
) -> None:
    url, job, unnamed = served
    api = _client(url)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "w1 w2"},
        {"role": "user", "content": "w7 w8 w9"},
    ]
    templated = "system: w1 w2 user: w7 w8 w9 assistant:"
    expected = _text(_greedy(job, _ids(templated), 10))
    reply = api.chat.completions.create(
        model="my-llama", messages=messages, max_tokens=10, temperature=0
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.usage is not None and reply.usage.prompt_tokens == len(_ids(templated))
    stream = api.chat.completions.create(
        model="my-llama",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == (
        reply.usage.total_tokens
    )
    # A model whose tokenizer has no chat template: a 400 that says so.
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        api.chat.completions.create(model=unnamed.id, messages=messages, max_tokens=3)


def _own_logprobs(job: pipesvc.Job, prompt: list[int], made: list[int]) -> torch.Tensor:
    """``transformers``' log-probabilities in one process of each token after ``prompt``
    (``[len(made), vocab]``), on the job's weights."""
    model = AutoModelForCausalLM.from_pretrained(served_dir(job))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + made])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


def test_log_probabilities_are_transformers_own_whole_and_streamed(served: Served) -> None:
    url, job, _ = served
    api = _client(url)
    prompt = "w6 w2 w30"
    reply = api.completions.create(
        model="my-llama", prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    (choice,) = reply.choices
    scored = choice.logprobs
    assert scored is not None and scored.tokens is not None and choice.text
    made = [WORDS.index(t) for t in scored.tokens]
    assert _text(made) == choice.text
    own = _own_logprobs(job, _ids(prompt), made)
    assert scored.token_logprobs == pytest.approx(
        own.gather(1, torch.tensor(made)[:, None]).squeeze(1).tolist(), abs=1e-4
    )
    assert scored.top_logprobs is not None and scored.text_offset is not None
    for at, (top, offset) in enumerate(zip(scored.top_logprobs, scored.text_offset, strict=True)):
        values, ids = own[at].topk(3)
        assert top == pytest.approx(
            {WORDS[i]: v for i, v in zip(ids.tolist(), values.tolist(), strict=True)}, abs=1e-4
        )  # greedy: the chosen token is the most likely, so no fourth entry
        assert choice.text[offset:].lstrip().startswith(scored.tokens[at])
    # Streamed, the chunks carry the same tokens and figures between them.
    chunks = list(
        api.completions.create(
            model="my-llama", prompt=prompt, max_tokens=8, temperature=0, logprobs=3, stream=True
        )
    )
    pieces = [c.choices[0].logprobs for c in chunks]
    assert [t for p in pieces if p and p.tokens for t in p.tokens] == scored.tokens
    streamed = [v for p in pieces if p and p.token_logprobs for v in p.token_logprobs]
    assert streamed == pytest.approx(scored.token_logprobs, abs=1e-6)
    # Chat: true, with alternatives; sampled tokens get the model's figures too.
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "w7 w8"}]
    chat = api.chat.completions.create(
        model="my-llama", messages=messages, max_tokens=6, temperature=0.8, seed=11,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None
    words = [entry.token for entry in content.content]
    assert " ".join(words) == chat.choices[0].message.content
    own = _own_logprobs(job, _ids("user: w7 w8 assistant:"), [WORDS.index(w) for w in words])
    for at, entry in enumerate(content.content):
        assert entry.logprob == pytest.approx(float(own[at, WORDS.index(entry.token)]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert [alt.token for alt in entry.top_logprobs] == [WORDS[i] for i in own[at].topk(2)[1]]
    # Out of range, or alternatives without logprobs: a 400 naming the parameter.
    with pytest.raises(openai.BadRequestError) as many:
        api.completions.create(model="my-llama", prompt=prompt, max_tokens=2, logprobs=21)
    assert many.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError, match="needs logprobs set to true"):
        api.chat.completions.create(
            model="my-llama", messages=messages, max_tokens=2, top_logprobs=2
        )


def test_stop_strings_end_the_text_before_them(
    served: Served,
) -> None:
    url, job, _ = served
    api = _client(url)
    prompt = "w11 w12 w13"
    words = _text(_greedy(job, _ids(prompt), 20)).split()
    assert len(words) >= 4, words
    # The stop string spans the end of one word and the start of the next token's text.
    stop = f"{words[2][1:]} {words[3]}"
    text = " ".join(words)
    expected = text[: text.index(stop)]
    reply = api.completions.create(
        model="my-llama", prompt=prompt, max_tokens=20, temperature=0, stop=["w99", stop]
    )
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (expected, "stop")
    streamed = api.completions.create(
        model="my-llama", prompt=prompt, max_tokens=20, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_refusals_are_openai_errors(served: Served) -> None:
    url, _, _ = served
    api = _client(url)
    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model="no-such-model", prompt="w1", max_tokens=2)
    assert missing.value.code == "model_not_found" and "my-llama" in missing.value.message
    with pytest.raises(openai.AuthenticationError):
        _client(url, TOKEN + "x").models.list()
    with pytest.raises(openai.AuthenticationError):
        _client(url, TOKEN + "x").completions.create(model="my-llama", prompt="w1")
    with pytest.raises(openai.BadRequestError) as many:
        api.completions.create(model="my-llama", prompt="w1", n=2)
    assert many.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="positions exceed"):
        api.completions.create(model="my-llama", prompt="w1", max_tokens=400)
    # The raw error body is OpenAI's shape.
    status, _, body = _post(url, "completions", {"model": "my-llama", "prompt": "w1", "n": 3})
    assert status == 400
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def _post(url: str, route: str, body: dict[str, object]) -> tuple[int, str, bytes]:
    """One POST with the token: the status, the content type and the body."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    try:
        connection.request("POST", f"{parts.path.rstrip('/')}/{route}", json.dumps(body), headers)
        reply = connection.getresponse()
        return reply.status, reply.headers["Content-Type"], reply.read()
    finally:
        connection.close()


def _stage_caches(address: str, token: str | None = TOKEN) -> tuple[int, int]:
    """(sessions, cache bytes) a stage holds."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        info = stage_pb2_grpc.StageServiceStub(channel).Info(
            stage_pb2.InfoRequest(), timeout=10, metadata=metadata
        )
    return info.sessions, info.cache_bytes


def test_the_stream_is_server_sent_events_and_a_client_gone_frees_every_stage(
    served: Served,
) -> None:
    url, job, _ = served
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    prompt = "w4 w5"
    assert len(_greedy(job, _ids(prompt), 30)) == 30  # no end of sequence soon: still running
    body = {"model": "my-llama", "prompt": prompt, "max_tokens": 200, "stream": True}
    body["temperature"] = 0
    connection.request("POST", f"{parts.path.rstrip('/')}/completions", json.dumps(body), headers)
    reply = connection.getresponse()
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    first = reply.readline()
    assert first.startswith(b"data: {") and reply.readline() == b"\n"
    assert json.loads(first[len(b"data: ") :])["object"] == "text_completion"
    held = [_stage_caches(stage.address) for stage in job.plan]
    assert all(sessions == 1 and size > 0 for sessions, size in held), held
    # The client goes away mid-stream.
    connection.sock.shutdown(socket.SHUT_RDWR)
    reply.close()
    connection.close()
    gone = time.monotonic()
    while (now := [_stage_caches(s.address) for s in job.plan]) != [(0, 0)] * len(job.plan):
        assert time.monotonic() - gone < 1.0, f"1 s after the disconnect the stages hold {now}"
        time.sleep(0.02)
    # A whole stream ends with [DONE].
    status, kind, raw = _post(url, "completions", {**body, "max_tokens": 3})
    events = raw.decode().split("\n\n")
    assert status == 200 and kind.startswith("text/event-stream")
    assert events[-2:] == ["data: [DONE]", ""]


def test_job_names_are_checked_and_unique(served: Served) -> None:
    _, job, _ = served
    with pytest.raises(InvalidArgumentError, match="is not a name"):
        pipesvc.JobConfig(model="wordy", name="bad name!")
    address = job._client.address
    with (
        pipesvc.connect(address, token=TOKEN) as client,
        pytest.raises(InvalidArgumentError, match="is taken by open job"),
    ):
        client.create_job(model="wordy", optimizer=None, num_stages=1, name="my-llama")


def test_a_full_kv_budget_is_a_429_with_the_sizes(tmp_path: Path) -> None:
    model = save_chat_model(tmp_path / "chat", chat_template=TEMPLATE)
    with (
        pipesvc.LocalCluster(
            num_stages=1,
            hf_models={"wordy": model},
            stage_args=["--kv-budget", "4KiB"],
            coordinator_args=["--http-port", "0"],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(model="wordy", optimizer=None, num_stages=1, name="small"),
    ):
        url = api_url(cluster)
        api = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        prompt = " ".join(WORDS[i % 40] for i in range(60))
        with pytest.raises(
            openai.RateLimitError, match=r"MiB on this stage, over its budget of"
        ) as full:
            api.completions.create(model="small", prompt=prompt, max_tokens=2)
        assert full.value.status_code == 429 and full.value.code == "kv_budget_full"
        # A short prompt fits.
        assert api.completions.create(model="small", prompt="w1", max_tokens=2).choices


def _open_stream(url: str, prompt: str, token: str = TOKEN) -> http.client.HTTPConnection:
    """A streamed greedy completion of ``model`` "small" posted; its answer is not read."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = {"model": "small", "prompt": prompt, "max_tokens": 100, "stream": True}
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    connection.request(
        "POST", f"{parts.path.rstrip('/')}/completions", json.dumps({**body, "temperature": 0}),
        headers,
    )  # fmt: skip
    return connection


def _hang_up(connection: http.client.HTTPConnection) -> None:
    assert connection.sock is not None
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()


@pytest.mark.timeout(120)
def test_a_client_gone_while_its_session_waits_for_room_costs_no_run(tmp_path: Path) -> None:
    """A session waiting for room in the KV budget (see [Note: waiting for room]) whose
    Generate call is cancelled before its first token is dropped then: when room frees, it
    does not run. (The HTTP API's watch for a gone client is tested in
    tests/unit/test_openai_first_step.py: over a real socket its timing races the first
    session's growth.)"""
    model = save_chat_model(tmp_path / "chat", chat_template=TEMPLATE)
    with (
        pipesvc.LocalCluster(
            num_stages=1,
            hf_models={"wordy": model},
            stage_args=["--kv-budget", "32KiB"],  # 64 positions of this model
            coordinator_args=["--http-port", "0", "--metrics-port", "0"],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(model="wordy", optimizer=None, num_stages=1, name="small") as job,
    ):
        url = api_url(cluster)
        stage = job.plan[0].address
        first = " ".join(f"w{i}" for i in range(4, 14))
        assert EOS not in job.generate(torch.tensor([_ids(first)]), 12)[0].tolist()
        started = coordinator_metric(cluster, "time_to_first_token_seconds_count")
        holder = _open_stream(url, first)
        reply = holder.getresponse()
        assert reply.status == 200 and reply.readline().startswith(b"data: {")
        # 56 positions do not fit beside the first session's 10 or more, so the second
        # session waits; the first has about 50 positions to grow before it fills the budget.
        waiting = [WORDS[i % 40] for i in range(56)]
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            request = coordinator_pb2.GenerateRequest(
                job_id=job.id, input_ids=encode(torch.tensor([_ids(" ".join(waiting))])),
                max_new_tokens=4,
            )  # fmt: skip
            call = stub.Generate(request, timeout=60)
            deadline = time.monotonic() + 30
            while coordinator_metric(cluster, "generation_evictions_total") < 1:
                assert time.monotonic() < deadline, "the second session never waited for room"
                time.sleep(0.01)
            call.cancel()
            log = cluster.log_dir / "coordinator.log"
            deadline = time.monotonic() + 10
            while "a session's client went away after 0 of its tokens" not in log.read_text():
                assert time.monotonic() < deadline, "the server did not see the call go"
                time.sleep(0.05)
        reply.close()
        _hang_up(holder)
        deadline = time.monotonic() + 10
        while _stage_caches(stage, token=None) != (0, 0):
            assert time.monotonic() < deadline, "the first session's caches were not freed"
            time.sleep(0.02)
        time.sleep(1.0)
        # Only the first session made a token: the second never ran.
        assert coordinator_metric(cluster, "time_to_first_token_seconds_count") == started + 1
        assert _stage_caches(stage, token=None) == (0, 0)


README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readmes_api_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's curl and ``openai`` examples, on the Hugging Face example's model, with a
    free port for 8080 and a free coordinator address."""
    text = README.read_text()
    python = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    bash = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    [hf_example] = [b for b in python if b.startswith("# Bring a Hugging Face model")]
    [client_example] = [b for b in python if b.startswith("# The OpenAI-compatible API")]
    [commands] = [b for b in bash if "--http-port 8080" in b]
    [curl] = [b for b in bash if b.startswith("curl ") and "/v1/" in b]
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)  # the example's random weights, fixed: the greedy curl reply is exact
    exec(compile(hf_example, "README.md", "exec"), {})  # our own README, not input
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    address = _free_address()
    up, create = (shlex.split(line)[1:] for line in commands.strip().splitlines())
    up = [port if w == "8080" else w for w in up] + ["--listen", address]
    up += ["--threads-per-stage", "1"]
    cluster = subprocess.Popen(
        [sys.executable, "-m", "pipesvc", *up], stdout=subprocess.PIPE, text=True
    )
    try:
        assert cluster.stdout is not None
        while "coordinator at" not in (line := cluster.stdout.readline()):
            assert line, "pipesvc up ended early"
        made = subprocess.run(
            [sys.executable, "-m", "pipesvc", *create, "--coordinator", address],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        replied = subprocess.run(
            ["bash", "-c", curl.replace(":8080/", f":{port}/")],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        reply = json.loads(replied.stdout)
        assert reply["model"] == "tiny-llama" and reply["usage"]["completion_tokens"] == 16
        assert reply["choices"][0]["finish_reason"] == "length"
        # The streamed text is sampled (temperature 1) from a random model: it may hold line
        # breaks, decode to nothing at all, or end early on the end-of-sequence token (CI saw
        # all three). So the example also prints its last chunk's finish reason, which only a
        # stream that ran to its end carries: "length", or "stop" for an end-of-sequence token.
        ending = "\nprint(chunk.choices[0].finish_reason)\n"
        printed = subprocess.run(
            [sys.executable, "-c", client_example.replace(":8080/", f":{port}/") + ending],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        lines = printed.stdout.split("\n")
        assert lines[0] == "['tiny-llama']" and lines[-1] == "" and lines[-2] in ("length", "stop")
    finally:
        cluster.send_signal(signal.SIGINT)
        cluster.wait(timeout=60)
        if cluster.stdout is not None:
            cluster.stdout.close()


def _free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"
