"""What every command-line tool shares: bad input is one `error: ...` line and exit code 2, and
the process group a tool started is torn down on the way out."""

from __future__ import annotations

import argparse
import functools
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from data_prep.readers import FileReadError
from models.config import ConfigError
from pretrain.checkpoint_format import CheckpointError


class ToolError(RuntimeError):
    """A tool's input cannot be used; the message names the problem and the fix."""


# Problems with what the user gave, as opposed to bugs: reported in one line.
INPUT_ERRORS = (ToolError, CheckpointError, ConfigError, FileNotFoundError, FileReadError)


def argument_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A tool's parser: `python -m <module>` as its name, its module docstring as the help text.
    Pass the module's __spec__.name (its __name__ is "__main__" under python -m)."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def reports_errors(*extra: type[BaseException]):
    """Decorate a tool's main(argv) -> exit code: input errors (and `extra`) print `error: ...` and
    return 2."""
    caught = INPUT_ERRORS + extra

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapped(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except caught as err:
                print(f"error: {err}", file=sys.stderr, flush=True)
                return 2
        return wrapped
    return decorate


def check_out_dir(out: Path, sources: dict[str, Path | str | None]) -> None:
    """--out of a tool that writes a directory, replaced whole (--overwrite): not a file or a link,
    and not what the tool reads or a folder holding it (what is read first would be deleted).
    `sources`: {what: path}; None entries are skipped."""
    if out.is_symlink():
        raise ToolError(f"--out {out} is a link; give the directory itself ({out.resolve()})")
    if out.exists() and not out.is_dir():
        raise ToolError(f"--out {out} is a file; give a directory")
    where = out.resolve()
    for what, source in _resolved(sources):
        if where == source or where in source.parents:
            raise ToolError(f"--out {out} holds {what} ({source}); writing it would delete that: choose "
                            "another directory")


def check_out_file(out: Path, sources: dict[str, Path | str | None]) -> None:
    """--out of a tool that writes one file: not a directory, and not inside what the tool reads
    (replacing a file there would corrupt it)."""
    if out.is_dir():
        raise ToolError(f"--out {out} is a directory; give the file to write")
    where = out.resolve()
    for what, source in _resolved(sources):
        if where == source or source in where.parents:
            raise ToolError(f"--out {out} lies in {what} ({source}); choose a file elsewhere")


def _resolved(sources: dict[str, Path | str | None]) -> list[tuple[str, Path]]:
    return [(what, Path(source).resolve()) for what, source in sources.items() if source is not None]


def tool_device(name: str):
    """--device: auto (the GPU when there is one, else the CPU) or a torch device name."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ToolError(f"--device {name!r}: give auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ToolError(f"--device {name}: this machine has no GPU torch can use; pass --device cpu")
    return device


def _exit_on_signal(signum: int, frame) -> NoReturn:
    print(f"stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def run(main: Callable[[], int]) -> NoReturn:
    """Exit with a tool's main(), tearing down any process group it started. SIGTERM (timeout,
    kill, scancel) and SIGHUP stop it as Ctrl-C does: what it was writing is removed on the way out,
    not left as a hidden partial file."""
    from pretrain.distributed import destroy_distributed

    for stop in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(stop) is not signal.SIG_IGN:  # nohup's ignored SIGHUP stays ignored
            signal.signal(stop, _exit_on_signal)
    try:
        code = main()
    finally:
        destroy_distributed()
    sys.exit(code)
