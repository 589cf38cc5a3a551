"""DeepSpeed engine: ZeRO stage, precision, AdamW, learning-rate schedule, clipping."""

from __future__ import annotations

import torch
from torch import nn

from pretrain.config import Config
from pretrain.distributed import MegatronCoreMPU
from pretrain.schedule import client_scheduler


def use_bf16(cfg: Config) -> bool:
    if cfg.train.precision == "auto":
        return torch.cuda.is_available()
    return cfg.train.precision == "bf16"


def use_fused_optimizer(cfg: Config) -> bool:
    if cfg.train.fused_optimizer == "auto":
        return torch.cuda.is_available()
    return cfg.train.fused_optimizer == "true"


def deepspeed_config(cfg: Config) -> dict:
    t = cfg.train
    adamw = {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": 1e-8, "weight_decay": t.weight_decay,
             "torch_adam": True}
    if use_fused_optimizer(cfg):
        adamw["fused"] = True  # DeepSpeed hands it to torch.optim.AdamW (fused multi-tensor kernels)
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 10**9,  # the trainer prints its own progress line
        "wall_clock_breakdown": False,
        "bf16": {"enabled": use_bf16(cfg)},
        "zero_optimization": {
            "stage": cfg.parallel.zero_stage,
            "contiguous_gradients": True,
            "overlap_comm": torch.cuda.is_available(),
            "reduce_scatter": True,
        },
        "optimizer": {"type": "AdamW", "params": adamw},
    }


def param_groups(model: nn.Module) -> list[dict]:
    """No weight decay on norms and other vectors."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_engine(cfg: Config, model: nn.Module, load_universal: bool = False):
    """``load_universal``: the checkpoint to resume is a universal one (pretrain.universal)."""
    import deepspeed

    config = deepspeed_config(cfg)
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    optimizer = None
    if cfg.train.skip_spikes:
        # The same torch AdamW, built here so that pretrain.spikes can veto a step.
        from deepspeed.moe.utils import configure_moe_param_groups, has_moe_layers

        from pretrain.spikes import SkipStepAdamW

        params = config.pop("optimizer")["params"]
        params.pop("torch_adam")
        groups = param_groups(model)
        if has_moe_layers(model)[0]:  # what DeepSpeed does for the optimizers it builds itself
            groups = configure_moe_param_groups(groups)
        optimizer = SkipStepAdamW(groups, lr=params.pop("lr"), betas=tuple(params.pop("betas")), **params)
        config["zero_allow_untested_optimizer"] = True  # ZeRO checks the exact type; this is torch's AdamW
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=None if optimizer is not None else param_groups(model),
        optimizer=optimizer,
        config=config,
        mpu=MegatronCoreMPU(),
        lr_scheduler=client_scheduler(cfg.train),
    )
    return engine


def describe_optimizer(engine) -> str:
    """The torch optimizer under DeepSpeed's ZeRO/bf16 wrappers, e.g. "AdamW (fused)"."""
    optimizer = engine.basic_optimizer
    from pretrain.spikes import SkipStepAdamW

    name = "AdamW" if isinstance(optimizer, SkipStepAdamW) else type(optimizer).__name__
    notes = [n for n, on in (("fused", optimizer.defaults.get("fused")),
                             ("skips spikes", isinstance(optimizer, SkipStepAdamW))) if on]
    return name + (f" ({', '.join(notes)})" if notes else "")
