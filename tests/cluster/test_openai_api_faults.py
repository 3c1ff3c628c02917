"""The OpenAI-compatible API through a fault: a stage SIGKILLed in the middle of a streamed
completion is replaced by the spare, the session replays its tokens, and the stream goes on
with the text it would have had without the fault."""

from __future__ import annotations

import http.client
import json
import os
import signal
from pathlib import Path
from urllib.parse import urlsplit

import torch

import pipesvc
from tests.support.chat_model import EOS, TEMPLATE, WORDS, api_url, save_chat_model
from tests.support.faults import stage_pid


def test_a_stage_killed_mid_stream_leaves_the_text_unchanged(tmp_path: Path) -> None:
    model = save_chat_model(tmp_path / "chat", chat_template=TEMPLATE)
    with (
        pipesvc.LocalCluster(
            num_stages=3,
            threads_per_stage=1,
            hf_models={"wordy": model},
            coordinator_args=["--http-port", "0"],
        ) as cluster,
        cluster.connect() as client,
        client.create_job(model="wordy", optimizer=None, num_stages=2, name="my-llama") as job,
    ):
        url = urlsplit(api_url(cluster))
        prompt = [WORDS.index(w) for w in ["w6", "w2", "w30"]]
        new = job.generate(torch.tensor([prompt]), 24)[0, len(prompt) :].tolist()
        new = new[: new.index(EOS)] if EOS in new else new
        assert len(new) >= 8, new  # long enough to be cut in the middle
        expected = " ".join(WORDS[i] for i in new)

        assert url.hostname is not None and url.port is not None
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        body = {"model": "my-llama", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        connection.request(
            "POST",
            f"{url.path.rstrip('/')}/completions",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )
        reply = connection.getresponse()
        assert reply.status == 200
        pieces: list[str] = []
        victim = job.plan[1].address
        while (line := reply.readline()) != b"data: [DONE]\n":
            assert line, "the stream ended without [DONE]"
            if line.startswith(b"data: {"):
                event = json.loads(line[len(b"data: ") :])
                assert "error" not in event, event
                pieces.append(event["choices"][0]["text"])
                if len(pieces) == 3:
                    os.kill(stage_pid(victim), signal.SIGKILL)
        connection.close()
        assert "".join(pieces) == expected
        assert job.refresh().recoveries == 1
        assert victim not in [s.address for s in job.plan]
