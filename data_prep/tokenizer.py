"""A tokenizer directory as data_prep.train_tokenizer writes it, for every command that reads one:

    DIR/tokenizer.model   the SentencePiece model
    DIR/tokenizer.json    vocab size, special ids and the model's sha256 (shards and checkpoints
                          record that hash, so each can be traced back to its tokenizer)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer.json"
# Fixed special ids the training code and the exported models rely on.
SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_tokenizer(tokenizer_dir):
    """(SentencePieceProcessor, metadata) of DIR, with a clear error if absent or stale."""
    import sentencepiece as spm

    d = Path(tokenizer_dir)
    model, meta_file = d / MODEL_FILE, d / META_FILE
    if not model.is_file() or not meta_file.is_file():
        raise FileNotFoundError(f"no tokenizer at {d}: run python -m data_prep.train_tokenizer --out {d}")
    meta = json.loads(meta_file.read_text())
    if meta.get("sha256") != sha256_file(model):
        raise ValueError(f"{model} does not match the sha256 in {meta_file}: the model was replaced "
                         "after training; retrain it with --overwrite")
    return spm.SentencePieceProcessor(model_file=str(model)), meta
