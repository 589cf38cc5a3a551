"""Sparse MLP layers: a top-k router MoE and Union-of-Experts (UoE), sharing routing,
expert-parallel dispatch and the DeepSpeed expert container."""
