import os
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's kernels (bf16_adamw_fused) run in its interpreter where there is no GPU; set before transformers
    # and peft import Triton (a kernel defined before it is set would be compiled for a GPU)
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


SLOW_SECONDS = 10  # a test that takes longer belongs to the `slow` tier (`make test-fast` skips it)
_unmarked_slow: list[tuple[str, float]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    started = time.monotonic()
    yield
    took = time.monotonic() - started
    if took > SLOW_SECONDS and "slow" not in item.keywords:
        _unmarked_slow.append((item.nodeid, took))


def pytest_terminal_summary(terminalreporter):
    """Named, not failed: a loaded machine can slow any test, but the tiers must keep their meaning."""
    if _unmarked_slow:
        terminalreporter.section(f"tests over {SLOW_SECONDS} s without the slow marker")
        for nodeid, took in _unmarked_slow:
            terminalreporter.write_line(f"{took:6.1f} s  {nodeid}")
