"""Fused GPU kernels of the attention kinds (Triton), and what launching this project's kernels
needs (models/mlp/swiglu_triton.py's too). A kind imports its kernel module only when it runs on a
GPU, so machines without Triton never import one."""

import contextlib
import os

import torch

LISA_FLASH_MAX_GROUP = 4  # heads of an alignment group the fused LISA kernel holds as separate tiles
# Widths (source features, low-rank features, values) the fused LISA kernel takes once padded: at 256
# its passes over key blocks need more shared memory than an H100 / H200 has (bench.kernel_compile).
LISA_FLASH_MAX_WIDTH = 128


def triton_interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1: on CPU tensors, as the
    tests check them)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_its_device(x: torch.Tensor):
    """A context that launches kernels on x's GPU (Triton launches on the current one), or anywhere
    for CPU tensors (the interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def accumulator(dtype: torch.dtype):
    """The Triton type kernels accumulate in for inputs of `dtype`: float64 for float64 (the tests'
    reference precision), else float32."""
    import triton.language as tl  # here: this module is imported where Triton may be missing

    return tl.float64 if dtype == torch.float64 else tl.float32
