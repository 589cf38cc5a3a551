"""Attention kinds, one module each, chosen per layer by `model.attention`. models.registry imports
every module here, so a new file that registers a kind is found by itself (base.py and
lisa_conversion.py are helpers and register none).

A kind's layer takes (x, ctx). It publishes its pre-activation scores into
ctx["published_scores"] when the next layer reuses them (`publish_scores`, set by
models.registry.build_attention), which reads them from ctx["shared_scores"] (models.gpt passes
them on), and its weights into ctx["attention_maps"][layer] when
ctx["capture_attention"] is set (models.attention.base.ProjectedAttention does both).
"""
