"""Without a GPU, Triton kernels run through Triton's interpreter (must be set before they are defined)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
