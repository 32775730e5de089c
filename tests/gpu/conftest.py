"""GPU tests: marked `gpu`, skipped on machines without CUDA (CI), run on the H200 by hand."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
