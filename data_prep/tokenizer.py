"""A tokenizer directory as data_prep.train_tokenizer writes it, for every command that reads one:

    DIR/tokenizer.model   the SentencePiece model
    DIR/tokenizer.json    vocab size, special ids and the model's sha256 (shards and checkpoints
                          record that hash, so each can be traced back to its tokenizer)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from data_prep.parts import write_atomic, write_json_atomic

MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer.json"
# Fixed special ids the training code and the exported models rely on.
SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def install(out_dir: Path, model_tmp: Path, meta: dict, files: dict[str, bytes] | None = None) -> None:
    """Move a model written to model_tmp into out_dir with its record and other `files` (name: bytes),
    the record last: an interrupted install leaves no record beside files it does not describe
    (load_tokenizer then says so)."""
    (out_dir / META_FILE).unlink(missing_ok=True)
    for name, data in (files or {}).items():
        write_atomic(out_dir / name, data)
    os.replace(model_tmp, out_dir / MODEL_FILE)
    write_json_atomic(out_dir / META_FILE, meta)


def tokenizer_record(tokenizer_dir) -> dict:
    """DIR's tokenizer.json as this framework writes it (sha256 of the model, special ids, ...);
    ValueError naming the fix for another one (a Hugging Face tokenizer.json)."""
    d = Path(tokenizer_dir)
    meta_file = d / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or "sha256" not in meta:
        raise ValueError(f"{meta_file} is not this framework's tokenizer record (a Hugging Face tokenizer.json?): "
                         f"import the SentencePiece model with python -m data_prep.import_tokenizer --model "
                         f"{d / MODEL_FILE} --out TOKENIZER_DIR, and give TOKENIZER_DIR")
    return meta


def load_tokenizer(tokenizer_dir):
    """(SentencePieceProcessor, metadata) of DIR, with a clear error if absent or stale."""
    import sentencepiece as spm

    d = Path(tokenizer_dir)
    model, meta_file = d / MODEL_FILE, d / META_FILE
    imported = f"python -m data_prep.import_tokenizer --model {model} --out TOKENIZER_DIR"
    if model.is_file() and not meta_file.is_file():
        raise FileNotFoundError(f"{d} holds a SentencePiece model but no {META_FILE}: import it with {imported}, "
                                "and give TOKENIZER_DIR")
    if not model.is_file() or not meta_file.is_file():
        raise FileNotFoundError(f"no tokenizer at {d}: run python -m data_prep.train_tokenizer --out {d} "
                                "(or data_prep.import_tokenizer for an existing SentencePiece model)")
    meta = tokenizer_record(d)
    if meta.get("sha256") != sha256_file(model):
        raise ValueError(f"{model} does not match the sha256 in {meta_file}: the model was replaced "
                         "after training; retrain it with --overwrite")
    return spm.SentencePieceProcessor(model_file=str(model)), meta


def continuation_text(sp, prompt_ids: list[int], new: list[int]) -> str:
    """The text new ids add to the prompt's: decoded alone, a dummy-prefix tokenizer (Llama-2's)
    would drop the space the first new piece begins with."""
    head, whole = sp.decode(prompt_ids), sp.decode(prompt_ids + new)
    return whole[len(head):] if whole.startswith(head) else sp.decode(new)
