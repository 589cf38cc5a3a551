"""Small synthetic data for tests: shard sets with learnable token patterns (no tokenizer needed) and
code-like text for the tokenizer and shard-building tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from streaming import MDSWriter

FAKE_TOKENIZER_SHA = "0" * 64

WORDS = ("the quick brown fox jumps over lazy dog data model token shard train value sample "
         "def return class import self print for while if else none true false alpha beta gamma").split()


def make_text(rng: random.Random, lines: int) -> str:
    out = []
    for _ in range(lines):
        indent = "    " * rng.randrange(3)
        out.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12))))
    return "\n".join(out) + "\n"


def write_synthetic_shards(root: Path, vocab_size: int = 256, seq_len: int = 32, train: int = 256,
                           val: int = 16, seed: int = 0, eos_id: int | None = None,
                           garbage_every: int = 0) -> Path:
    """Distinct sequences that count upward with different starts and strides, so a model can
    learn them and tests can tell samples apart. With ``eos_id``, every sample also holds two document
    ends (at positions that move with the sample) and the manifest records the id. With
    ``garbage_every``, every such train sample is one token repeated: a loss spike once the patterns
    are learnt."""
    root = Path(root)
    span = vocab_size - 4
    for split, count, offset in (("train", train, 0), ("val", val, train)):
        with MDSWriter(out=str(root / "shards" / split), columns={"tokens": "ndarray:uint16"},
                       compression="zstd", size_limit=1 << 16) as writer:
            for i in range(offset + seed, offset + seed + count):
                start, stride = i % span, 1 + (i // span) % 7
                tokens = (start + stride * np.arange(seq_len + 1)) % span + 4
                if eos_id is not None:
                    tokens[[3 + i % 7, seq_len // 2 + i % 5]] = eos_id
                if garbage_every and split == "train" and i % garbage_every == garbage_every - 1:
                    tokens[:] = 4 + i % span
                writer.write({"tokens": tokens.astype(np.uint16)})
    manifest = {"seq_len": seq_len, "vocab_size": vocab_size, "tokenizer_sha256": FAKE_TOKENIZER_SHA,
                "splits": {"train": {"samples": train}, "val": {"samples": val}},  # as a build's manifest
                "bos_id": 1,  # the tokens themselves are >= 4
                **({"eos_id": eos_id} if eos_id is not None else {})}
    (root / "shards" / "manifest.json").write_text(json.dumps(manifest))
    (root / "tokenizer").mkdir(exist_ok=True)
    (root / "tokenizer" / "tokenizer.json").write_text(json.dumps({"vocab_size": vocab_size,
                                                                    "sha256": FAKE_TOKENIZER_SHA}))
    return root


def tiny_overrides(root: Path, run_dir: Path, **extra) -> list[str]:
    """Dotted overrides for a tiny model on the synthetic shards."""
    values = {
        "data.shards": root / "shards", "data.tokenizer": root / "tokenizer",
        "model.vocab_size": 256, "model.max_seq_len": 32, "model.hidden_size": 64, "model.num_heads": 4,
        "model.num_layers": 2, "model.ffn_hidden_size": 128, "train.micro_batch": 4, "train.steps": 8,
        "train.warmup_steps": 2, "train.log_interval": 1, "train.eval_interval": 4, "train.eval_batches": 2,
        "train.save_interval": 4, "train.lr": 3e-3, "run.dir": run_dir, "run.name": run_dir.name,
        "data.cache": Path(run_dir).parent / f"{Path(run_dir).name}-cache",  # decompressed shards, not in /tmp
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def use_disk_urls() -> None:
    """Let streaming read disk://PATH as a remote: a local directory behind a URL of the tests' own,
    so that remote shards are tested without a network (in every process that reads them)."""
    from streaming.base.storage import LocalDownloader, download

    class DiskURLDownloader(LocalDownloader):
        @staticmethod
        def _client_identifier() -> str:
            return "disk"

        def _download_file_impl(self, remote: str, local: str, timeout: float) -> None:
            super()._download_file_impl(remote.removeprefix("disk://"), local, timeout)

    download.DOWNLOADER_MAPPINGS["disk"] = DiskURLDownloader
