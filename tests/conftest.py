"""Shared fixtures: tiny checkpoints built once per test session, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# Without a GPU, Triton kernels run in Triton's interpreter (set before any kernel module
# is imported, since @triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: a second torch thread costs more in hand-offs than it
    saves (many times over on a busy machine). Use with ``pytestmark``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """tiny:FAMILY checkpoints go to a per-session cache, not the user's home."""
    path = tmp_path_factory.mktemp("ninfer-cache")
    old = os.environ.get("NINFER_CACHE_DIR")
    os.environ["NINFER_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("NINFER_CACHE_DIR", None)
    else:
        os.environ["NINFER_CACHE_DIR"] = old


def _make(tmp_path_factory, family: str) -> Path:
    from ninfer.tiny.make import make_tiny

    return make_tiny(tmp_path_factory.mktemp(f"tiny-{family}"), family, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return _make(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    return _make(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="session", params=["qwen3", "qwen3_moe"])
def tiny_model(request) -> Path:
    """Each family's tiny checkpoint in turn."""
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    """Only the tiny tokenizer's files (tokenizer.json, config, chat template); read-only."""
    from ninfer.tiny.tokenizer_files import write_tokenizer_files

    out = tmp_path_factory.mktemp("tiny_tok")
    write_tokenizer_files(out)
    return out


@pytest.fixture(scope="session")
def tok(tok_dir: Path):
    """The tiny tokenizer loaded through ninfer's own wrapper."""
    from ninfer.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tok_dir)
