from pathlib import Path

import pytest
import torch

from tunewright_jobs.tiny import build_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """The tiny GPT-2 and Llama (random init, local tokenizer), built once per test session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: build_model(kind, root / kind) for kind in ("gpt2", "llama")}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine); run through the device tool")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
