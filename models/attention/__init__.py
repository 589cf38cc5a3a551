"""Attention kinds, one module each, chosen per layer by `model.attention`; every module here
registers its kind with models.registry (a new file here is a new kind).

A kind's layer takes (x, ctx). It publishes its pre-activation scores into
ctx["attention_scores"][layer] when the next layer reuses them (`publish_scores`, set by
models.registry.build_attention), and its weights into ctx["attention_maps"][layer] when
ctx["capture_attention"] is set (models.attention.base.ProjectedAttention does both).
"""
