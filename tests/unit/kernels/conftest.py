"""Kernel tests: the Triton kernels run in the interpreter on CPU unless CUDA is present.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it is set here, at
import time, before any test module imports ``kvtier.kernels.triton_kv``. Without CUDA it
defaults to ``1`` (the CPU tests compare the interpreted kernels with the torch reference);
with CUDA it is left alone, so the kernels compile and the ``gpu`` tests run them on the device
(the interpreter reads host memory only and cannot follow the kernels' pointer tables into
device memory). ``TRITON_INTERPRET=1 pytest tests/unit/kernels`` forces the CPU tests on a GPU machine.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
