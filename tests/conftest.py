"""Shared test set-up: the project root on sys.path, one torch thread, and the `gpu` marker."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The scripts and benches the tests run as subprocesses inherit this: with one pytest worker per
# core, a subprocess on torch's default (every core) spin-waits against the other worker, and a
# bench that takes 12 s alone took over 280 s on CI beside a second one.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test model is tiny: a second thread buys nothing, and on a shared
    two-core CPU its spin-waits make a step several times slower."""
    try:
        import torch
    except ImportError:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
