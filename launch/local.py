"""Run the training entry point on this machine under torchrun.

    python -m launch.local configs/tiny_dense.yaml --nproc 2 train.steps=100
    python -m launch.local configs/1b_uoe.yaml --single-gpu     # the header's single-GPU layout
    python -m launch.local CONFIG --post --nproc 2 post.method=dpo ...   # posttrain.train instead

The config is validated for the requested world size before any process starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import socket
import sys
import warnings

if __name__ == "__main__":
    # Reading the config imports torch and megatron-core, whose import-time warnings rank 0 of the
    # run prints anyway: the launcher does not print them a second time.
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

from launch.entry_points import entry_point  # noqa: E402
from launch.layouts import one_gpu_hint, single_gpu_overrides  # noqa: E402
from pretrain.checkpoint_format import CheckpointError  # noqa: E402
from pretrain.config import ConfigError, load_config  # noqa: E402


def torchrun_command(nproc: int, config: str | None, overrides: list[str], port: int,
                     module: str = "pretrain.train") -> list[str]:
    cmd = [sys.executable, "-m", "launch.torchrun", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=is_host=1",  # one machine
           # Forward the time-limit signal to the workers and give them time to save.
           "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=300",
           "-m", module]
    if config:
        cmd += ["--config", config]
    return cmd + overrides


def check_port(port: int, in_use: bool) -> None:
    """A rendezvous port torchrun can take (`in_use`: also that nothing on this machine holds it now)."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port {port}: give a port from 1 to 65535 (default 29500)")
    if in_use:
        with socket.socket() as probe:
            # as torch's store binds: a port an earlier run left in TIME_WAIT is free, a listener's is not
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                raise ConfigError(f"--port {port} is in use (another run on this machine?): pass another --port"
                                  ) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    parser.add_argument("--nproc", type=int, default=1, help="processes on this machine (one per GPU)")
    parser.add_argument("--port", type=int, default=29500, help="rendezvous port")
    parser.add_argument("--single-gpu", action="store_true",
                        help="apply the config header's single-GPU layout (one process) before the overrides")
    parser.add_argument("--post", action="store_true", help="post-training (posttrain.train): SFT, DPO, SGA")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the command, run nothing")
    args = parser.parse_intermixed_args(argv)
    entry = entry_point(args.post)
    overrides = args.overrides
    if args.config and "=" in args.config and not os.path.exists(args.config):  # overrides alone: the defaults
        args.config, overrides = None, [args.config, *overrides]
    try:
        if args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}: give at least 1 process")
        check_port(args.port, in_use=not args.dry_run)
        if args.single_gpu:
            if not args.config:
                raise ConfigError("--single-gpu reads the layout from a config's header: name the config")
            if args.nproc != 1:
                raise ConfigError(f"--single-gpu runs one process, not --nproc {args.nproc}")
            overrides = single_gpu_overrides(args.config) + overrides
        entry.check(load_config(args.config, overrides, entry.config_class), args.nproc)
    except (ConfigError, CheckpointError) as err:
        hint = "" if args.single_gpu else one_gpu_hint(err, args.config, args.nproc)
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    command = torchrun_command(args.nproc, args.config, overrides, args.port, entry.module)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    # This process becomes the torchrun agent, so that a signal sent to it (kill, timeout, srun's
    # --signal) reaches the agent, which forwards it to the workers and waits while they save.
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    sys.exit(main())
