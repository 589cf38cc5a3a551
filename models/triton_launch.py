"""What launching this project's Triton kernels needs (models/attention/kernels and
models/mlp/kernels/swiglu_triton.py). Nothing here imports Triton at module level: the kinds import this
on machines without it."""

import contextlib
import os

import torch


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
