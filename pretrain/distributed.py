"""Process-group setup under torchrun or srun, megatron-core parallel state, and the `mpu`
adapter DeepSpeed needs."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def read_env() -> DistEnv:
    """Rank layout from torchrun's variables, or from Slurm's when srun starts the processes.

    The Slurm values are exported under torchrun's names, since DeepSpeed and streaming read those.
    """
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
        tasks_per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        os.environ.setdefault("LOCAL_WORLD_SIZE", tasks_per_node or os.environ["SLURM_NTASKS"])
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    for key, value in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", local_rank),
                       ("LOCAL_WORLD_SIZE", local_world_size)):
        os.environ.setdefault(key, str(value))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    return DistEnv(rank, world_size, local_rank, local_world_size)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(tensor: int = 1, expert: int = 1, backend: str | None = None) -> DistEnv:
    """Start the default process group (nccl on GPU, gloo on CPU, unless `backend` says otherwise)
    and megatron-core's groups."""
    env = read_env()
    if not torch.cuda.is_available():
        # DeepSpeed picks its accelerator at import time; without a GPU it must be the CPU one.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tensor, expert_model_parallel_size=expert)
    return env


RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def environment_for_child() -> dict[str, str]:
    """os.environ without this process's rank and rendezvous variables: a child process that
    starts its own process group must not join (or collide with) this one's."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(backend: str | None = None) -> DistEnv:
    """Rank 0 of 1 for tools and benchmarks started without torchrun/srun, on a free local port
    (two tools at once must not meet on one fixed port). A no-op where a TP=1/EP=1 group exists."""
    if dist.is_initialized() and ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() != 1 or ps.get_expert_model_parallel_world_size() != 1:
            raise RuntimeError("this tool builds the model at tensor/expert-parallel size 1; "
                               "run it in a single process")
        return read_env()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    # These tools run models on the CPU too (megatron's loss all-reduces even at TP=1), and NCCL
    # takes CUDA tensors only: gloo serves the CPU ones.
    default = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    return init_distributed(1, 1, backend=backend or default)


def dp_mean(value: torch.Tensor) -> float | list[float]:
    """Mean over the data-parallel group (tensor-parallel peers hold the same value), of a scalar
    or elementwise; non-finite on every rank when it is on any."""
    value = value.detach().float().clone()
    group = ps.get_data_parallel_group()
    dist.all_reduce(value, group=group)
    return (value.double() / dist.get_world_size(group)).tolist()


def rank_zero_value(value: str) -> str:
    """Rank 0's value of a string each rank found on its own, on every rank (a run directory's
    newest checkpoint moves when that run saves between the ranks' starts)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def destroy_distributed() -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class MegatronCoreMPU:
    """What DeepSpeed calls on `mpu`, answered from megatron-core's parallel state.

    megatron-core dropped the legacy `get_model_parallel_rank/world_size` and
    `get_data_parallel_group_ranks` that DeepSpeed still uses.
    """

    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(ps.get_tensor_model_parallel_src_rank)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(ps.get_pipeline_model_parallel_world_size)
    get_model_parallel_group = staticmethod(ps.get_model_parallel_group)
    get_data_parallel_group = staticmethod(ps.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(ps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(ps.get_data_parallel_world_size)

    @staticmethod
    def get_model_parallel_rank() -> int:
        return dist.get_rank(group=ps.get_model_parallel_group())

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return dist.get_world_size(group=ps.get_model_parallel_group())

    @staticmethod
    def get_data_parallel_group_ranks() -> list[int]:
        return dist.get_process_group_ranks(ps.get_data_parallel_group())
