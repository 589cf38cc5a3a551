"""Use an existing SentencePiece model (a Llama-2 ``tokenizer.model``, say) as a tokenizer directory.

    python -m data_prep.import_tokenizer --model path/to/llama-2-7b/tokenizer.model --out data/llama_tok

Copies the model to ``OUT/tokenizer.model`` and writes ``OUT/tokenizer.json`` with what the model
itself says (vocab size, special ids, model type, byte fallback, normalisation) and its sha256, so
build_shards, tools.import_hf --tokenizer and training use it like one trained here. Continued
pretraining of an imported model needs shards built with its own tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.tokenizer import MODEL_FILE, install, sha256_file


class NotSentencePiece(ValueError):
    pass


def describe_model(model_file: Path) -> dict:
    """What tokenizer.json records, read from the SentencePiece model itself."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    try:
        sp = spm.SentencePieceProcessor(model_file=str(model_file))
    except (RuntimeError, OSError) as e:
        raise NotSentencePiece(
            f"{model_file} is not a SentencePiece model ({str(e).strip()}): pass the tokenizer.model of a "
            "Llama-2-style checkpoint; Hugging Face tokenizer.json (BPE/WordPiece) and tiktoken files cannot "
            "be used") from None
    proto = model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    if sp.eos_id() < 0:
        raise NotSentencePiece(f"{model_file} has no end-of-sequence piece: build_shards separates documents "
                               "with EOS, so this model cannot be used for shards")
    return {
        "vocab_size": sp.get_piece_size(),
        "unk_id": sp.unk_id(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "pad_id": sp.pad_id(),
        "model_type": model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower(),
        "byte_fallback": proto.trainer_spec.byte_fallback,
        "normalization": proto.normalizer_spec.name,
        "add_dummy_prefix": proto.normalizer_spec.add_dummy_prefix,
    }


def import_tokenizer(model, out_dir, *, overwrite: bool = False) -> dict:
    """Copy ``model`` (a file, or a directory holding tokenizer.model) into ``out_dir``; return the metadata."""
    model, out_dir = Path(model), Path(out_dir)
    if model.is_dir():
        model = model / MODEL_FILE
    if not model.is_file():
        raise FileNotFoundError(f"no SentencePiece model at {model}: pass --model path/to/tokenizer.model "
                                "(or the checkpoint directory that holds it)")
    meta = describe_model(model)
    if (out_dir / MODEL_FILE).exists() and not overwrite:
        raise FileExistsError(f"tokenizer already exists at {out_dir}: pass --overwrite to replace it")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (MODEL_FILE + ".tmp")
    tmp.write_bytes(model.read_bytes())
    meta.update(sha256=sha256_file(tmp), imported_from=str(model.resolve()))
    install(out_dir, tmp, meta)
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_prep.import_tokenizer", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a SentencePiece tokenizer.model, or the directory holding one")
    p.add_argument("--out", required=True, help="tokenizer directory to write (tokenizer.model, tokenizer.json)")
    p.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --out")
    args = p.parse_args(argv)
    try:
        meta = import_tokenizer(args.model, args.out, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"imported {meta['model_type']} tokenizer, vocab {meta['vocab_size']} (unk {meta['unk_id']}, bos "
          f"{meta['bos_id']}, eos {meta['eos_id']}, pad {meta['pad_id']}) into {args.out} "
          f"(sha256 {meta['sha256'][:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
