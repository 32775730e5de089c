"""Without a GPU, Triton kernels run through Triton's interpreter (must be set before they are defined)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of thousands of tiny ops (DeepSeek-V4's tests): with the CPU shared, a second thread's
    spin-waits cost far more than it gives."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
