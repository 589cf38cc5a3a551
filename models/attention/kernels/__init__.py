"""Fused GPU kernels of the attention kinds (Triton). A kind imports its kernel module only when it
runs on a GPU, so machines without Triton never import one (models/triton_launch.py: what
launching them needs)."""

LISA_FLASH_MAX_GROUP = 4  # heads of an alignment group the fused LISA kernel holds as separate tiles
# Widths (source features, low-rank features, values) the fused LISA kernel takes once padded: at 256
# its passes over key blocks need more shared memory than an H100 / H200 has (bench.kernel_compile).
LISA_FLASH_MAX_WIDTH = 128
