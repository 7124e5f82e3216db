"""Where the CUDA tests run, and what happens on a machine without a GPU.

Without an NVIDIA GPU they are skipped. On a GPU machine (NVIDIA device nodes, or
``KVZCH_REQUIRE_CUDA=1`` as ``tools/gpu/check.sh`` sets) where torch sees no CUDA device, they
fail at collection instead: a run that skipped everything there would pass and prove nothing.
``KVZCH_CUDA_TEST_DEVICE=cpu`` runs them with the CPU (gloo) standing in for the GPU (NCCL), to
rehearse them and the GPU script where no GPU is lent; that checks their logic, not CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("KVZCH_CUDA_TEST_DEVICE", "cuda"))
BACKEND = "nccl" if DEVICE.type == "cuda" else "gloo"


def on_gpu_machine() -> bool:
    return os.environ.get("KVZCH_REQUIRE_CUDA") == "1" or os.path.exists("/dev/nvidiactl")


def requires_cuda() -> pytest.MarkDecorator:
    """The ``pytestmark`` of a module of CUDA tests (see the module docstring)."""
    if DEVICE.type != "cuda" or torch.cuda.is_available():
        return pytest.mark.cuda
    if on_gpu_machine():
        pytest.fail(f"this is a GPU machine but torch {torch.__version__} sees no CUDA device "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, torch built for "
                    f"CUDA {torch.version.cuda}): fix the driver or the torch build, or unset "
                    "KVZCH_REQUIRE_CUDA", pytrace=False)
    return pytest.mark.skip(reason="needs a CUDA device (tools/gpu/check.sh runs these on a GPU machine)")
