"""Many clients of the OpenAI-compatible API at once, each checked token by token against the
model in one process.

24 clients of the official ``openai`` package start at staggered times from threads of their
own, more than the coordinator's worker pools would serve one thread each: completions from text
and from token ids, whole and streamed; chats through the template; stop strings; sampled ones
with a seed; and streams the client drops halfway. Every greedy token must be the arg-max of
the model in one process run over the prompt and the tokens before it (within float rounding:
fused runs sum in another order); a choice that ends with ``stop`` and no stop string ended on
the end-of-sequence token, and one that ends with ``length`` made ``max_tokens``. Once every
client is done, no stage holds a session.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

import pipesvc
from tests.support.chat_model import EOS, TEMPLATE, WORDS, api_url, save_chat_model
from tests.support.stage_probe import stage_info

TOLERANCE = 1e-4
CLIENTS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, pipesvc.Job, Path]]:
    folder = tmp_path_factory.mktemp("openai-mix")
    model = save_chat_model(folder / "chat", chat_template=TEMPLATE)
    with (
        pipesvc.LocalCluster(
            num_stages=2, threads_per_stage=1, hf_models={"wordy": model},
            coordinator_args=["--http-port", "0"],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(model="wordy", optimizer=None, num_stages=2, name="mix") as job,
    ):  # fmt: skip
        url = api_url(cluster)
        yield url, job, model


@dataclass
class Call:
    """One client's request, and what came back."""

    kind: str
    prompt: list[int]
    max_tokens: int
    delay_s: float
    options: dict[str, Any] = field(default_factory=dict)
    drop_after: int | None = None
    text: str = ""
    finish_reason: str | None = None


def _words(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def _ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def draw_calls(seed: int) -> list[Call]:
    rng = random.Random(seed)
    kinds = ["text", "ids", "stream", "chat", "stop", "sampled", "dropped"] * 3 + ["stream"] * 3
    rng.shuffle(kinds)
    calls = []
    for kind in kinds:
        prompt = [rng.randrange(40) for _ in range(rng.randint(1, 30))]
        call = Call(kind, prompt, rng.randint(1, 40), rng.uniform(0.0, 0.6))
        if kind == "stop":
            call.options = {"stop": [rng.choice(["w1", "w2 w3", "w4"])]}
        elif kind == "sampled":
            call.options = {"temperature": 0.9, "top_p": 0.9, "seed": rng.randrange(1000)}
        elif kind == "dropped":
            call.max_tokens = rng.randint(10, 40)
            call.drop_after = rng.randint(1, 5)
        elif kind == "chat":
            # The template makes "user: <words> assistant:" of the message.
            call.prompt = [WORDS.index("user:"), *call.prompt, WORDS.index("assistant:")]
        calls.append(call)
    return calls


def make(api: openai.OpenAI, call: Call) -> None:
    time.sleep(call.delay_s)
    common: dict[str, Any] = {"model": "mix", "max_tokens": call.max_tokens, "temperature": 0}
    common.update(call.options)
    if call.kind == "chat":
        content = _words(call.prompt[1:-1])
        chat = api.chat.completions.create(
            messages=[{"role": "user", "content": content}], **common
        )
        call.text = chat.choices[0].message.content or ""
        call.finish_reason = chat.choices[0].finish_reason
        assert chat.usage is not None and chat.usage.prompt_tokens == len(call.prompt)
        return
    prompt: str | list[int] = call.prompt if call.kind == "ids" else _words(call.prompt)
    if call.kind in ("stream", "dropped", "sampled"):
        stream = api.completions.create(prompt=prompt, stream=True, **common)
        for index, chunk in enumerate(stream):
            if chunk.choices:
                call.text += chunk.choices[0].text
                call.finish_reason = chunk.choices[0].finish_reason or call.finish_reason
            if call.drop_after is not None and index + 1 == call.drop_after:
                stream.close()  # the client goes away mid-stream
                return
        return
    reply = api.completions.create(prompt=prompt, **common)
    call.text = reply.choices[0].text
    call.finish_reason = reply.choices[0].finish_reason


def check(model: Any, call: Call) -> None:
    """Every new token of ``call`` is the model's arg-max after the ones before it."""
    new = _ids(call.text)
    if call.drop_after is None:
        assert call.finish_reason in ("stop", "length"), (call.kind, call.finish_reason)
        assert len(new) <= call.max_tokens
    if call.finish_reason == "length":
        assert len(new) == call.max_tokens, (call.kind, len(new), call.max_tokens)
    for stop in call.options.get("stop", []):
        assert stop not in call.text, (call.text, stop)
    if call.kind == "sampled":
        return  # its tokens are drawn; that they are words of the model is checked above
    sequence = torch.tensor([call.prompt + new])
    with torch.no_grad():
        logits = model(sequence).logits[0].double()
    for step in range(len(new) + 1):
        if step == len(new) and not (call.finish_reason == "stop" and "stop" not in call.options):
            break  # nothing to say of the token after the last (a limit or a stop string)
        scores = logits[len(call.prompt) + step - 1]
        token = new[step] if step < len(new) else EOS  # a "stop": the end-of-sequence token
        lead = float(scores.max() - scores[token])
        assert lead <= TOLERANCE * max(1.0, float(scores.abs().max())), (
            f"{call.kind}, step {step}: {WORDS[token]} is {lead:.3g} below the arg-max "
            f"{WORDS[int(scores.argmax())]}"
        )


@pytest.mark.parametrize("seed", [1, 2])
def test_clients_of_every_kind_at_once_get_the_models_tokens(
    served: tuple[str, pipesvc.Job, Path], seed: int
) -> None:
    url, job, directory = served
    api = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    calls = draw_calls(seed)
    assert len(calls) == CLIENTS
    model: Any = AutoModelForCausalLM.from_pretrained(directory).eval()
    for call in calls:
        if call.kind == "stop":  # a stop string the greedy text reaches: its 3rd and 4th words
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([call.prompt]), max_new_tokens=4, do_sample=False,
                    eos_token_id=EOS,
                )[0, len(call.prompt) :].tolist()  # fmt: skip
            if len(out) == 4 and EOS not in out:
                call.options = {"stop": [_words(out[2:])]}
                call.max_tokens = max(call.max_tokens, 4)
    errors: list[str] = []

    def client(call: Call) -> None:
        try:
            make(api, call)
        except Exception as exc:  # reported below, with the call's kind
            errors.append(f"{call.kind}: {exc!r}")

    threads = [threading.Thread(target=client, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    # The dropped streams' sessions are released on every stage too.
    deadline = time.monotonic() + 5
    while any(stage_info(s.address).sessions for s in job.plan):
        assert time.monotonic() < deadline, [stage_info(s.address) for s in job.plan]
        time.sleep(0.1)
    assert any(c.kind == "stop" and c.finish_reason == "stop" for c in calls)
    for call in calls:
        check(model, call)
