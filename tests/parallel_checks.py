"""Worker functions for layer- and model-level parallel equivalence tests (run under spawn)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def full_tensor(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """Reassemble a tensor-parallel shard (or return a replicated tensor as is)."""
    if not getattr(param, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return tensor.detach().clone()
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def gpt_loss_and_grads(rank: int, model_kwargs: dict, out_path: str, seed: int = 0,
                       activation_checkpointing: bool = False, compile_blocks: bool = False,
                       z_loss: float = 0.0, eos_id: int | None = None) -> None:
    """Build a GPT with a fixed seed, run one forward/backward on a fixed batch and save the
    loss plus full (TP-gathered) gradients from rank 0 (and whether torch.compile made graphs)."""
    from models.config import ModelConfig, apply_values
    from models.gpt import GPT

    # Sections as config objects (moe=MoEConfig(...)) or as plain dicts (lisa={"align_group": 2}).
    cfg = ModelConfig(**{k: v for k, v in model_kwargs.items() if not isinstance(v, dict)})
    apply_values(cfg, {k: v for k, v in model_kwargs.items() if isinstance(v, dict)}, "model.")
    torch.manual_seed(seed)
    model = GPT(cfg, activation_checkpointing=activation_checkpointing, z_loss=z_loss)
    # Full checkpointing starts each block again in backward (counted at the start: the recompute
    # stops once it has what backward needs). Eager blocks only.
    block_forwards = [0]
    if compile_blocks:
        model.compile_blocks()
    else:
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: block_forwards.__setitem__(0, block_forwards[0] + 1))
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    documents = None
    if eos_id is not None:  # packed documents: ends at different places in the two rows
        tokens[tokens == eos_id] = eos_id + 1
        tokens[0, [4, 11]] = tokens[1, [7]] = eos_id
        from models.attention.masks import document_ids

        documents = document_ids(tokens[:, :-1], eos_id)
    loss = model(tokens[:, :-1], tokens[:, 1:], documents)
    loss.backward()
    forwards = block_forwards[0]
    grads = {name: full_tensor(p, p.grad) for name, p in model.named_parameters()}
    weights = {name: full_tensor(p, p.data) for name, p in model.named_parameters()}
    with torch.no_grad():  # every rank: the forward holds tensor-parallel collectives
        logits = model.logits(tokens[:, :-1], {"document_ids": documents})
    if rank == 0:
        from torch._dynamo.utils import counters

        compiled = counters["stats"]["unique_graphs"] > 0
        torch.save({"loss": loss.detach(), "grads": grads, "weights": weights, "compiled": compiled,
                    "block_forwards": forwards, "z_loss": model.last_metrics.get("z_loss"), "logits": logits}, out_path)


def loader_batches(rank: int, shards_root: str, out_dir: str, batches: int = 3) -> None:
    """Save the first micro-batches this rank's training loader yields."""
    from pretrain.config import Config
    from pretrain.data import Batches, build_loader

    cfg = Config()
    cfg.data.shards = f"{shards_root}/shards"
    cfg.train.micro_batch = 4
    it = Batches(build_loader(cfg, "train", shuffle=True))
    torch.save(torch.cat([next(it) for _ in range(batches)]), f"{out_dir}/rank{rank}.pt")


def meta_param_counts(rank: int, config_paths: list[str], out_path: str) -> None:
    """Instantiate each config's model on the meta device; save counted vs instantiated sizes."""
    from models.counting import param_counts
    from models.gpt import GPT
    from pretrain.config import load_config

    results = {}
    for path in config_paths:
        cfg = load_config(path)
        with torch.device("meta"):
            model = GPT(cfg.model)
        results[path] = (param_counts(cfg.model)["total"], sum(p.numel() for p in model.parameters()))
    torch.save(results, out_path)


def gathered_initial_weights(rank: int, model_overrides: list[str], source: str, out_path: str) -> None:
    """A GPT at the spawned layout started from `source` (pretrain.init_from.load_weights); rank 0
    saves the full (TP-gathered) weights."""
    from pathlib import Path

    from models.gpt import GPT
    from pretrain.config import load_config
    from pretrain.init_from import load_weights

    model = GPT(load_config(None, model_overrides).model)
    load_weights(model, Path(source))
    weights = {name: full_tensor(p, p.data) for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(weights, out_path)


def cross_entropy_and_logsumexp_grads(rank: int, out_path: str) -> None:
    """models.cross_entropy on this rank's vocabulary slice of fixed logits: both outputs, weighted
    by fixed per-position weights, and the gradient of the full logits (gathered)."""
    from models.cross_entropy import cross_entropy_and_logsumexp

    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 5, 12, generator=gen)
    labels = torch.randint(0, 12, (2, 5), generator=gen)
    w_ce, w_lse = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    width = 12 // ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * width
    mine = logits[..., start:start + width].clone().requires_grad_()
    ce, lse = cross_entropy_and_logsumexp(mine, labels)
    ((ce * w_ce).sum() + (lse * w_lse).sum()).backward()
    parts = [torch.empty_like(mine) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, mine.grad, group=ps.get_tensor_model_parallel_group())
    if rank == 0:
        torch.save({"logits": logits, "labels": labels, "w_ce": w_ce, "w_lse": w_lse, "ce": ce.detach(),
                    "lse": lse.detach(), "grad": torch.cat(parts, -1)}, out_path)


def bytes_saved_for_backward(rank: int, model_kwargs: dict, z_loss: float, out_path: str) -> None:
    """Bytes of the distinct storages a GPT's training forward keeps for backward."""
    from models.config import ModelConfig
    from models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(**model_kwargs), z_loss=z_loss)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    torch.save(sum(storages.values()), out_path)
