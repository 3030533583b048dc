"""GPU tests: the CUDA kernels against the torch reference. Skipped without CUDA (CI)."""

import pytest

torch = pytest.importorskip("torch")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
