"""Shared fixtures: tiny HF-layout checkpoints made on the fly (random weights, byte-level tokenizer)."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# What the tests write outside their tmp_path goes to one folder, removed when the session ends: the kernel plans
# they measure (a throwaway cache, never the user's ~/.cache) and the temporary files of the commands they start
# (torchrun's). This process's own temporary folder stays the machine's: pytest keeps a failed test's files there.
tempfile.gettempdir()
_SESSION_DIR = tempfile.mkdtemp(prefix="grpo-tests-")
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
os.environ.setdefault("GRPO_CACHE_DIR", os.path.join(_SESSION_DIR, "cache"))
os.environ["TMPDIR"] = _SESSION_DIR
# One thread (below), fixed: the kernel plan must not measure and raise it (tests/model/test_kernel_plan.py
# measures on purpose).
os.environ.setdefault("GRPO_THREADS", "1")

from grpo_engine.model.tiny import make_tiny_checkpoint  # noqa: E402

# One thread: the tiny models gain nothing from more, and on a shared, loaded CPU OpenMP threads that
# spin-wait for each other make every op 10-100x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt_factory(tmp_path_factory):
    """Returns make(arch, **overrides) -> path; checkpoints are cached per (arch, overrides)."""
    made = {}

    def make(arch: str = "qwen2", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = make_tiny_checkpoint(out, arch, **overrides)
        return made[key]

    return make


@pytest.fixture
def tiny_ckpt(tiny_ckpt_factory):
    return tiny_ckpt_factory("qwen2")


@pytest.fixture(autouse=True)
def _no_tf32_leaks():
    """apply_memory_config turns TF32 on for CUDA (memory.allow_tf32); later fp32 parity tests need it off."""
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
