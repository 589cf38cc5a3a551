"""Fused GPU kernels of the MLP kinds (Triton), apart from the kind modules the registry imports:
a kind imports its kernel only when it runs on a GPU, so machines without Triton never import one."""
