"""Import a local Hugging Face Llama-architecture model as a training checkpoint.

    python -m tools.import_hf --model HF_DIR --out RUN_DIR [--tokenizer TOK_DIR] [--max-seq-len N]
        [--start-with-bos auto|true|false]

Writes RUN_DIR/checkpoints/step_00000000 through a real single-process DeepSpeed engine
(pretrain.engine.build_engine + pretrain.checkpoint.save, ZeRO-1, fresh optimizer state) and
RUN_DIR/config.yaml with the model section filled in (data.tokenizer = --tokenizer, empty without
one; set data.shards and the train.* keys for the run). Continue training with

    python -m pretrain.train --config RUN_DIR/config.yaml data.shards=... train.resume=RUN_DIR/checkpoints/step_00000000

Accepted: `LlamaForCausalLM` with silu MLP, no attention/MLP biases, no rope_scaling, head_dim =
hidden / heads, grouped-query attention (kept: model.num_kv_heads). Any other architecture or
setting is refused with a clear error and nothing is written to --out.

Mapping (the inverse of tools.export): q/k/v rows -> the fused QKV weight grouped by K/V head,
gate/up rows -> the interleaved SwiGLU w_in, embedding and head padded to model.vocab_pad_to with
zero rows (padded logits are 0 until training pushes them down; --vocab-pad-to 1 avoids padding
when the vocabulary is divisible by the tensor-parallel size you will train at).

Start training from it at any layout (tensor / data parallel, ZeRO 0-3) with

    python -m pretrain.train --config RUN_DIR/config.yaml data.shards=... run.dir=runs/continued \
        parallel.tensor=2 train.init_from=RUN_DIR/checkpoints/step_00000000

(pretrain.init_from re-splits the weights; optimizer and schedule start fresh). Resuming it with
train.resume also works at tensor-parallel size 1 and ZeRO 0-2: the marker says there is no
optimizer state worth restoring (optimizer_state: false), so pretrain.checkpoint.load keeps the
weights and starts the optimizer fresh.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models import registry
from models.config import ModelConfig
from tools.cli import ToolError, argument_parser, check_out_dir, reports_errors, run


class UnsupportedModel(ToolError):
    """The Hugging Face model cannot be imported as it is."""


def read_hf_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise UnsupportedModel(f"--model {model_dir}: no config.json there (expected a Hugging Face model folder)")
    return json.loads(path.read_text())


# Architectures that are Llama's, weights named alike (Mistral: where its sliding window covers every position).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


def check_supported(hf: dict) -> None:
    arch = hf.get("architectures") or []
    if arch != [ARCHITECTURES.get(hf.get("model_type"))]:
        raise UnsupportedModel(f"unsupported architecture {arch or hf.get('model_type')!r} (model_type="
                               f"{hf.get('model_type')!r}): only {' and '.join(ARCHITECTURES.values())} (a "
                               "Llama architecture) can be imported")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    problems = []
    window = hf.get("sliding_window")
    if hf["model_type"] == "mistral" and window is not None and window < hf.get("max_position_embeddings", 2048):
        problems.append(f"sliding_window={window} below max_position_embeddings="
                        f"{hf.get('max_position_embeddings', 2048)} (the framework attends to every earlier position)")
    if heads % kv:
        problems.append(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (need silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        problems.append("attention_bias / mlp_bias (the framework's projections have no bias)")
    scaling = hf.get("rope_scaling") or {}
    if scaling and scaling.get("rope_type", scaling.get("type")) != "default":
        problems.append(f"rope_scaling={hf['rope_scaling']!r} (only plain RoPE)")
    rope = hf.get("rope_parameters") or {}  # newer configs: the RoPE type and theta together
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters={rope!r} (only plain RoPE)")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if hf["hidden_size"] % heads or head_dim * heads != hf["hidden_size"]:
        problems.append(f"head_dim={head_dim} x heads={heads} != hidden_size={hf['hidden_size']}")
    if problems:
        raise UnsupportedModel("unsupported Llama settings: " + "; ".join(problems))


def model_config_from_hf(hf: dict, max_seq_len: int | None, vocab_pad_to: int) -> ModelConfig:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    rope = hf.get("rope_theta")
    if rope is None:
        rope = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
        max_seq_len=max_seq_len if max_seq_len is not None else hf.get("max_position_embeddings", 2048),
        rope_base=float(rope),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)), vocab_pad_to=vocab_pad_to,
        attention="softmax", mlp="dense", num_kv_heads=kv_heads if kv_heads != heads else 0,
    )


def load_hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def from_llama_state(cfg, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> framework names/layouts at TP=1 (padded vocabulary), each
    layer's attention and MLP through their kinds' Llama mappings."""
    v, pv = cfg.vocab_size, cfg.padded_vocab_size

    def pad(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w, w.new_zeros(pv - v, w.shape[1])]) if pv > v else w

    out = {"embed.weight": pad(hf["model.embed_tokens.weight"]), "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["head.weight"] = pad(hf["lm_head.weight"])
    for i, attn in enumerate(cfg.attention_kinds()):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        out.update(registry.attention_kind(attn).llama.from_llama(cfg, hf, src + "self_attn.", dst + "attn."))
        out.update(registry.mlp_kind(cfg.mlp_kind(i)).llama.from_llama(cfg, hf, src + "mlp.", dst + "mlp."))
        out[dst + "attn_norm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "mlp_norm.weight"] = hf[src + "post_attention_layernorm.weight"]
    return {k: t.float().contiguous().clone() for k, t in out.items()}


def hf_starts_with_bos(model_dir: Path, hf_cfg: dict) -> tuple[bool, str]:
    """Whether the model's texts begin with BOS, and why: as its own tokenizer in the folder encodes
    a text, else (no tokenizer there) when its config names a BOS id, as Llama models are trained."""
    bos = hf_cfg.get("bos_token_id")
    if bos is None:
        return False, "its config names no bos_token_id"
    if any((model_dir / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")):
        try:
            from transformers import AutoTokenizer

            ids = AutoTokenizer.from_pretrained(model_dir).encode("a")
        except Exception as err:  # noqa: BLE001 - an unloadable tokenizer: decide by the config
            return True, (f"its tokenizer did not load ({type(err).__name__}); its config names "
                          f"bos_token_id {bos}")
        starts = bool(ids) and ids[0] == bos
        return starts, f"its tokenizer {'begins' if starts else 'does not begin'} a text with BOS"
    return True, f"its config names bos_token_id {bos} (no tokenizer in the folder)"


def import_model(model_dir: str | Path, out: str | Path, tokenizer: str | None = None,
                 max_seq_len: int | None = None, vocab_pad_to: int = 128, overwrite: bool = False,
                 start_with_bos: str = "auto", log=print) -> Path:
    """`start_with_bos`: auto (as the model's tokenizer does, hf_starts_with_bos), true or false:
    data.start_with_bos of the run, so that generation, evaluation and later training give the
    model's texts the BOS it was trained with."""
    from models.gpt import GPT
    from pretrain import checkpoint
    from pretrain.config import Config, validate
    from pretrain.distributed import init_single_process

    model_dir, out = Path(model_dir), Path(out)
    check_out_dir(out, {"the Hugging Face model": model_dir, "the tokenizer": tokenizer})
    hf_cfg = read_hf_config(model_dir)
    check_supported(hf_cfg)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UnsupportedModel(f"--out {out} exists and is not empty; choose a new run directory or pass --overwrite")
    tokenizer_sha = None
    if tokenizer:
        from data_prep.tokenizer import MODEL_FILE, load_tokenizer

        if not (Path(tokenizer) / MODEL_FILE).is_file():  # a tokenizer trained now could not match the model's
            raise ToolError(f"--tokenizer {tokenizer}: no {MODEL_FILE} there; give the directory data_prep."
                            f"import_tokenizer made from the model's own tokenizer.model")

        sp, meta = load_tokenizer(tokenizer)
        if sp.get_piece_size() != hf_cfg["vocab_size"]:
            raise UnsupportedModel(f"--tokenizer {tokenizer} has {sp.get_piece_size()} tokens but the model's "
                               f"vocab_size is {hf_cfg['vocab_size']}")
        tokenizer_sha = meta["sha256"]
    cfg = Config()
    cfg.model = model_config_from_hf(hf_cfg, max_seq_len, vocab_pad_to)
    cfg.run.name, cfg.run.dir = out.name, str(out)
    cfg.parallel.tensor, cfg.parallel.zero_stage = 1, 1
    cfg.train.precision = "fp32"
    # Without --tokenizer the run names none: the default data/tokenizer may be another model's.
    cfg.data.tokenizer = str(tokenizer) if tokenizer else ""
    if start_with_bos == "auto":
        starts, why = hf_starts_with_bos(model_dir, hf_cfg)
        log(f"data.start_with_bos={str(starts).lower()}: {why} (--start-with-bos true|false to choose)")
    else:
        starts = start_with_bos == "true"
    if starts and hf_cfg.get("bos_token_id") is None:
        raise UnsupportedModel("--start-with-bos true, but the model's config names no bos_token_id")
    cfg.data.start_with_bos = starts
    validate(cfg, 1)
    state = from_llama_state(cfg.model, load_hf_state(model_dir))

    init_single_process()
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    own = model.state_dict()
    state.update({k: v for k, v in own.items() if k.endswith("_extra_state")})
    model.load_state_dict(state, strict=True)
    special = {name: hf_cfg.get(f"{name}_token_id") for name in ("bos", "eos", "pad")}
    ids = {f"{k}_id": v for k, v in special.items() if k != "pad" and v is not None}  # as a run's meta has them
    return checkpoint.save_weights_run(model, cfg, out, {"tokenizer_sha256": tokenizer_sha,
                                                         "start_with_bos": cfg.data.start_with_bos,
                                                         "imported_from": str(model_dir.resolve()), **ids,
                                                         "special_ids": {k: v for k, v in special.items()
                                                                         if v is not None}})


@reports_errors(ValueError)
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--model", required=True, help="local Hugging Face model folder")
    parser.add_argument("--out", required=True, help="new run directory")
    parser.add_argument("--tokenizer", default=None, help="SentencePiece tokenizer dir of this model (optional)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: max_position_embeddings")
    parser.add_argument("--vocab-pad-to", type=int, default=128)
    parser.add_argument("--start-with-bos", choices=("auto", "true", "false"), default="auto",
                        help="data.start_with_bos of the run (auto: as the model's own tokenizer does)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    path = import_model(args.model, args.out, args.tokenizer, args.max_seq_len, args.vocab_pad_to, args.overwrite,
                        args.start_with_bos)
    print(f"wrote {path} and {Path(args.out) / 'config.yaml'}")
    return 0


if __name__ == "__main__":
    run(main)
