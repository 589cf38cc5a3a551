"""DeepSpeed engine: ZeRO stage, precision, AdamW, learning-rate schedule, clipping."""

from __future__ import annotations

import functools

import torch
from torch import nn

from pretrain.config import Config, switched_on
from pretrain.distributed import MegatronCoreMPU
from pretrain.schedule import client_scheduler


def use_bf16(cfg: Config) -> bool:
    if cfg.train.precision == "auto":
        return torch.cuda.is_available()
    return cfg.train.precision == "bf16"


def use_fused_optimizer(cfg: Config) -> bool:
    return switched_on(cfg.train.fused_optimizer)


def vetoes_invalid_norms(cfg: Config) -> bool:
    """Whether a step with a non-finite gradient is refused by its global gradient norm instead of by
    DeepSpeed's overflow scan: in bf16 (no loss scale to adjust) under ZeRO-2 with clipping, that
    norm is computed anyway and is non-finite whenever a gradient is, while the scan runs four small
    kernels per parameter tensor (a 1B UoE has 611 tensors; the H200 profile of its step had 10% in
    elementwise multiplies). The step is then vetoed by SkipStepAdamW (invalid_global_norm). At
    ZeRO-1, bf16 runs DeepSpeed's BF16_Optimizer (fp32 gradient sums), which refuses such a step by
    its norm itself."""
    return use_bf16(cfg) and cfg.train.grad_clip > 0 and cfg.parallel.zero_stage == 2


def invalid_global_norm(zero) -> bool:
    """Whether DeepSpeed's ZeRO optimizer found the global gradient norm of this step non-finite
    (reported as inf, or as -1 where its helpers mask it)."""
    from deepspeed.runtime.utils import is_invalid_grad_norm

    return zero._global_grad_norm is not None and is_invalid_grad_norm(zero._global_grad_norm)


def deepspeed_config(cfg: Config) -> dict:
    t = cfg.train
    adamw = {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": 1e-8, "weight_decay": t.weight_decay,
             "torch_adam": True}
    if use_fused_optimizer(cfg):
        adamw["fused"] = True  # DeepSpeed hands it to torch.optim.AdamW (fused multi-tensor kernels)
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 10**9,  # the trainer prints its own progress line
        "wall_clock_breakdown": False,
        "bf16": {"enabled": use_bf16(cfg), "check_grad_overflow": not vetoes_invalid_norms(cfg)},
        "zero_optimization": {
            "stage": cfg.parallel.zero_stage,
            "contiguous_gradients": True,
            "overlap_comm": torch.cuda.is_available(),
            "reduce_scatter": True,
        },
        "optimizer": {"type": "AdamW", "params": adamw},
    }
    if use_bf16(cfg) and cfg.parallel.zero_stage in (1, 2, 3):
        # Gradients summed over micro-batches and reduced over ranks in fp32, as Megatron-LM, torchtitan
        # and OLMo-core do: in bf16 a sum of 8 micro-batches loses about 0.5% of each gradient, and small
        # ones vanish (1 + 0.003 = 1). ZeRO-0 cannot (DeepSpeed's bf16 wrapper accumulates in bf16).
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"
    return config


# 2: parameters marked `no_weight_decay` are not decayed; 1 (checkpoints saved before) decayed every
# parameter of two or more dimensions. Recorded in checkpoints: a run resumes with its saved groups.
DECAY_GROUPS = 2


def param_groups(model: nn.Module, version: int = DECAY_GROUPS) -> list[dict]:
    """No weight decay on norms and other vectors, nor on parameters a model marks
    `no_weight_decay` (LISA's head mixing, which starts as the identity, and its 2-D biases)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            matrix = param.dim() >= 2 and (version < 2 or not getattr(param, "no_weight_decay", False))
            (decay if matrix else no_decay).append(param)
    return [
        {"params": decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_engine(cfg: Config, model: nn.Module, load_universal: bool = False,
                 decay_groups: int = DECAY_GROUPS):
    """``load_universal``: the checkpoint to resume is a universal one (pretrain.universal).
    ``decay_groups``: the DECAY_GROUPS version of the checkpoint to resume."""
    import deepspeed

    config = deepspeed_config(cfg)
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    optimizer = None
    if cfg.train.skip_spikes or vetoes_invalid_norms(cfg):
        # The same torch AdamW, built here so that a step can be vetoed (pretrain.spikes, invalid norms).
        from deepspeed.moe.utils import configure_moe_param_groups, has_moe_layers

        from pretrain.spikes import SkipStepAdamW

        params = config.pop("optimizer")["params"]
        params.pop("torch_adam")
        groups = param_groups(model, decay_groups)
        if has_moe_layers(model)[0]:  # what DeepSpeed does for the optimizers it builds itself
            groups = configure_moe_param_groups(groups)
        optimizer = SkipStepAdamW(groups, lr=params.pop("lr"), betas=tuple(params.pop("betas")), **params)
        config["zero_allow_untested_optimizer"] = True  # ZeRO checks the exact type; this is torch's AdamW
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=None if optimizer is not None else param_groups(model, decay_groups),
        optimizer=optimizer,
        config=config,
        mpu=MegatronCoreMPU(),
        lr_scheduler=client_scheduler(cfg.train),
    )
    if vetoes_invalid_norms(cfg):  # the trainer's spike guard, where on, replaces it (and skips these too)
        engine.basic_optimizer.should_skip = functools.partial(invalid_global_norm, engine.optimizer)
    if cfg.parallel.zero_stage == 3:
        gather_tied_embeddings(model)
    return engine


def gather_tied_embeddings(model: nn.Module) -> None:
    """ZeRO-3 gathers a parameter only while the module that owns it runs: a tied output layer
    reads the embedding's weight after the embedding ran, so it is registered with the head too
    (else the head gets an empty partition)."""
    import deepspeed

    from models.gpt import GPT

    for module in model.modules():  # the model itself, or the policy inside a post-training wrapper
        if isinstance(module, GPT) and module.cfg.tie_embeddings:
            deepspeed.zero.register_external_parameter(module.head, module.embed.weight)


def describe_optimizer(engine, skips_spikes: bool) -> str:
    """The torch optimizer under DeepSpeed's ZeRO/bf16 wrappers, e.g. "AdamW (fused)"."""
    optimizer = engine.basic_optimizer
    from pretrain.spikes import SkipStepAdamW

    name = "AdamW" if isinstance(optimizer, SkipStepAdamW) else type(optimizer).__name__
    notes = [n for n, on in (("fused", optimizer.defaults.get("fused")), ("skips spikes", skips_spikes))
             if on]
    return name + (f" ({', '.join(notes)})" if notes else "")
