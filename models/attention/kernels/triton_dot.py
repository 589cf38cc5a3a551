"""tl.dot at the precision the kernels' callers ask for (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b; IEEE: exact float32 products (for float32 callers; else TF32 for float32 operands)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out
