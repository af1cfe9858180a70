"""Test tiers. Without a GPU every kernel runs through Triton's CPU interpreter, which must be switched on before
any kernel module is imported, so this file sets TRITON_INTERPRET first. With a GPU (the H200 tier, `pytest -m
gpu`) the same tests run on the device, plus the `gpu`-marked ones at real sizes."""

import fcntl
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter runs tiny tiles through numpy; extra BLAS threads only fight the pytest-xdist workers.
    torch.set_num_threads(1)

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory():
    """pytest-xdist's workers share the GPU, and PyTorch's caching allocator keeps each one's peak: after a test
    that left more than 4 GiB cached, hand it back, so that the large tests below find room."""
    yield
    if DEVICE == "cuda" and torch.cuda.memory_reserved() > 4 << 30:
        torch.cuda.empty_cache()


@pytest.fixture
def large_gpu_memory():
    """For a test that needs tens of GB: one such test at a time across the workers (a file lock), with this
    worker's cache emptied first."""
    with open(os.path.join(tempfile.gettempdir(), "flashtile-large-gpu-test.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    if DEVICE != "cuda":
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)
    else:
        skip = pytest.mark.skip(reason="CPU tier: runs kernels through Triton's interpreter, which this process has off")
        for item in items:
            if item.get_closest_marker("interpreter"):
                item.add_marker(skip)
    # The sm_90 compile groups (test_compile.py) take minutes each: they go first, so that pytest-xdist's workers
    # run the short interpreter tests beside the last of them instead of one group alone at the end.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_compile.py"))


def pytest_runtest_logreport(report):
    """With FLASHTILE_TEST_FAILURES=PATH, append each failure to PATH as it happens: a GPU session's run cut short
    by its time limit still tells which tests failed and why (pytest prints its summary only at the end)."""
    path = os.environ.get("FLASHTILE_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"{report.nodeid} ({report.when})\n{report.longreprtext[-3000:]}\n\n")


@pytest.fixture(autouse=True)
def _fresh_problem_memo(monkeypatch):
    """Each test starts with ops/call.py's problem memo empty: tests that patch what the dispatch reads (the
    interpreter flag, a device's capability, tile tables) would otherwise meet problems remembered before."""
    from flashtile.ops import call

    monkeypatch.setattr(call, "_MEMO", {})
