"""A tiny Llama saved with a word tokenizer, a chat template and an end-of-sequence token, for
the coordinator's OpenAI-compatible API (nothing downloaded)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM

import pipesvc

WORDS = [f"w{i}" for i in range(40)] + ["user:", "assistant:", "system:", "</s>"]
EOS = WORDS.index("</s>")
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def word_tokenizer() -> Tokenizer:
    """A tokenizer with one token per word of ``WORDS``, words split on white space."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def save_chat_model(directory: Path, *, chat_template: str | None) -> Path:
    """The model in ``directory``, with ``chat_template`` in its tokenizer_config.json."""
    torch.manual_seed(5)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
        eos_token_id=EOS, bos_token_id=EOS,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    word_tokenizer().save(str(directory / "tokenizer.json"))
    settings: dict[str, object] = {"eos_token": "</s>"}
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def api_url(cluster: pipesvc.LocalCluster, timeout_s: float = 30.0) -> str:
    """The base URL of the OpenAI-compatible API a ``LocalCluster``'s coordinator serves (its
    ``--http-port``), from the coordinator's log once it says so."""
    log = cluster.log_dir / "coordinator.log"
    deadline = time.monotonic() + timeout_s
    while not (found := re.search(r"OpenAI-compatible API on (\S+)", log.read_text())):
        assert time.monotonic() < deadline, f"no API in {log}"
        time.sleep(0.1)
    return found.group(1)
