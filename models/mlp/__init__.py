"""MLP kinds, one module each, chosen by `model.mlp`. models.registry imports every module here,
so a new file that registers a kind is found by itself. The sparse kinds live in models/moe/."""
