"""Registers the Hugging Face model directories named in ``PIPESVC_TEST_HF_MODELS``
(``name=dir;name=dir``): a ``--models`` module for stages started by a test."""

from __future__ import annotations

import os

from pipesvc import register_hf_model

for entry in filter(None, os.environ.get("PIPESVC_TEST_HF_MODELS", "").split(";")):
    name, _, directory = entry.partition("=")
    register_hf_model(name, directory)
