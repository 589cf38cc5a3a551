"""Real multi-process runs on gloo for tests: torchrun for whole training runs, spawned
workers for layer-level checks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from pretrain.distributed import RENDEZVOUS_VARS, environment_for_child, free_port

REPO = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict:
    """This environment for a child process, without a process group of this one's (see
    single_process_group): children start their own."""
    env = environment_for_child()
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun(nproc: int, args: list[str], timeout: float = 600, check: bool = True,
             **env: str) -> subprocess.CompletedProcess:
    """Run `python -m torch.distributed.run --nproc-per-node nproc <args>` from the repo root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def train(nproc: int, overrides: list[str], **kwargs) -> subprocess.CompletedProcess:
    return torchrun(nproc, ["-m", "pretrain.train", *overrides], **kwargs)


def saved_run_copy(saved_run: Path, run: Path, *steps: int) -> Path:
    """`run` holding copies of `saved_run`'s checkpoints of `steps`, `latest` the last: the run
    directory of a run that saved them and stopped (or was killed). Returns the last tag."""
    import shutil

    for step in steps:
        tag = run / "checkpoints" / f"step_{step:08d}"
        shutil.copytree(saved_run / "checkpoints" / tag.name, tag)
    (tag.parent / "latest").write_text(tag.name)
    return tag


def _worker(rank: int, world: int, port: int, tensor: int, expert: int, fn, args, errors) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    from pretrain.distributed import destroy_distributed, init_distributed

    try:
        init_distributed(tensor, expert)
        fn(rank, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        destroy_distributed()


def spawn(fn, world: int, *args, tensor: int = 1, expert: int = 1) -> None:
    """Run fn(rank, *args) on `world` gloo processes with megatron-core parallel state set up.
    fn must be importable (module level); failures re-raise with the worker's traceback."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, tensor, expert, fn, args, errors))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or any(p.exitcode != 0 for p in procs):
        raise AssertionError("worker failed:\n" + "\n".join(failures or [f"exit codes {[p.exitcode for p in procs]}"]))


@contextlib.contextmanager
def single_process_group():
    """This pytest process as a one-rank gloo group with megatron-core parallel state at TP=1;
    the group and the environment it set are removed afterwards."""
    from pretrain.distributed import destroy_distributed, init_distributed

    saved = {k: os.environ.get(k) for k in RENDEZVOUS_VARS}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_distributed(1, 1)
    try:
        yield
    finally:
        destroy_distributed()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
