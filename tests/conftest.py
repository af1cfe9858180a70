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


# A readers-writer lock for the workers sharing a GPU: every test holds it shared, a test that needs tens of GB
# exclusively, so that it never meets another worker's test halfway through its allocations (on an 80 GB card,
# eight workers' ordinary tests beside a 35 GB one ran out of memory). flock alone would starve the writer (new
# shared locks are granted while it waits, and some worker's test is always running), so a second file is a
# turnstile: a reader passes it on its way in, a writer holds it while it waits and runs.
_LOCKS = {}


def _lock_file(name):
    if name not in _LOCKS:
        _LOCKS[name] = open(os.path.join(tempfile.gettempdir(), f"flashtile-gpu-{name}.lock"), "w")
    return _LOCKS[name]


@pytest.fixture(autouse=True)
def _share_the_gpu():
    """On the GPU tier, hold the workers' lock shared for the test, and after it hand back this worker's cached
    memory beyond 1 GiB: pytest-xdist's workers share the GPU, and PyTorch's caching allocator keeps each one's
    peak. Yields what large_gpu_memory calls to hold the lock exclusively instead (None without a GPU)."""
    if DEVICE != "cuda":
        yield None
        return
    turnstile, lock = _lock_file("turnstile"), _lock_file("tests")
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    fcntl.flock(lock, fcntl.LOCK_SH)
    fcntl.flock(turnstile, fcntl.LOCK_UN)
    alone = []

    def run_alone():
        # The shared lock goes first, so that two such tests cannot each wait on the other's.
        torch.cuda.empty_cache()
        fcntl.flock(lock, fcntl.LOCK_UN)
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        alone.append(True)
        fcntl.flock(lock, fcntl.LOCK_EX)

    try:
        yield run_alone
    finally:
        if torch.cuda.memory_reserved() > 1 << 30:
            torch.cuda.empty_cache()
        fcntl.flock(lock, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture
def large_gpu_memory(_share_the_gpu):
    """For a test that needs tens of GB: it runs alone on the GPU (the workers' lock held exclusively, once every
    other worker's test has ended and returned its cache), with this worker's cache emptied first."""
    if _share_the_gpu is not None:
        _share_the_gpu()


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
