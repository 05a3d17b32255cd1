"""Fixtures shared by test_remix.py and test_runs.py: the tiny offline model and a file of short problems."""

import os
from pathlib import Path

import pytest

from tiny_model import build_tiny_model, write_short_problems

HERE = Path(__file__).resolve().parent
TRAIN = Path(os.environ.get("REMIX_DATA", HERE.parent / "shared" / "data")) / "train" / "deepscaler_partial.jsonl"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"))


@pytest.fixture(scope="session")
def train_file(tmp_path_factory):
    """Short problems from the shared DeepScaleR part keep the byte-level prompts small."""
    assert TRAIN.exists(), f"training data not found at {TRAIN}; set REMIX_DATA to shared/data"
    return write_short_problems(TRAIN, tmp_path_factory.mktemp("data") / "train.jsonl", max_chars=120, limit=64)
