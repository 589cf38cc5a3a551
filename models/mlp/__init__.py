"""MLP kinds, one module each, chosen by `model.mlp`; every module here registers its kind with
models.registry (a new file here is a new kind). The sparse kinds live in models/moe/."""
