"""Run the training entry point on this machine under torchrun.

    python -m launch.local configs/tiny_dense.yaml --nproc 2 train.steps=100

The config is validated for the requested world size before any process starts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from pretrain.config import ConfigError, load_config, validate, validate_data


def torchrun_command(nproc: int, config: str | None, overrides: list[str], port: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           # Forward the time-limit signal to the workers and give them time to save.
           "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=300",
           "-m", "pretrain.train"]
    if config:
        cmd += ["--config", config]
    return cmd + overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    parser.add_argument("--nproc", type=int, default=1, help="processes on this machine (one per GPU)")
    parser.add_argument("--port", type=int, default=29500, help="rendezvous port")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg, args.nproc)
        validate_data(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    return subprocess.call(torchrun_command(args.nproc, args.config, args.overrides, args.port), env=env)


if __name__ == "__main__":
    sys.exit(main())
