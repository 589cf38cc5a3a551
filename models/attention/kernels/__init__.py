"""Fused GPU kernels of the attention kinds (Triton). A kind imports its kernel module only when
it runs on a GPU, so machines without Triton never import one."""
