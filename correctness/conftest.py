"""Shared fixtures: the small random HF checkpoints of checkpoints.py, and the embedded default target."""
from __future__ import annotations

import os

import pytest
import torch

import engine
from engine.loading import default_target_dir
from perf import preflight

from .checkpoints import TINY, make_tiny_checkpoint

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one core per xdist worker: oversubscribed intra-op threads slow everything down


def pytest_configure(config):
    preflight.install(config, "correctness")  # its gpu tests on a runner whose CUDA is broken: a usage error


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_checkpoint(root, name, seed=i) for i, name in enumerate(TINY)}


@pytest.fixture(scope="session")
def default_target():
    return engine.load_target("smollm2-135m", "cpu", torch.float32)


@pytest.fixture(scope="session")
def default_hf_dir():
    return default_target_dir()
