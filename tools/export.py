"""Export a training checkpoint as a Hugging Face model folder.

    python -m tools.export --checkpoint RUN_DIR[/checkpoints/step_XXXXXXXX] --out DIR [--dtype bf16|fp32]

Reads any saved layout (tensor parallel, data parallel with ZeRO 0-3; see pretrain.consolidate)
and writes DIR/config.json, model.safetensors (sharded above --max-shard-size, with an index),
generation_config.json and the tokenizer (tokenizer.model + tokenizer.json + tokenizer_config.json,
loadable as LlamaTokenizer and LlamaTokenizerFast; it encodes text to the same ids as the
SentencePiece model used for training: no BOS/EOS added, no dummy prefix, byte fallback).
Heads a post-training run added beside the LM (SGA's value head) are written next to it as
NAME.safetensors and NAME.json (shape, objectives, chat and score formats).

Dense softmax models become a standard `LlamaForCausalLM` (a kind with neither a Llama mapping nor
support in the bundled modeling file is refused with an error):

* fused QKV rows grouped by K/V head [kv_head, q_1..q_g|k|v, head_dim] -> q_proj / k_proj /
  v_proj, num_key_value_heads = model.num_kv_heads (no RoPE permutation: both use the half-split
  rotate_half layout, theta = model.rope_base);
* interleaved SwiGLU rows (gate_n, up_n) -> gate_proj / up_proj; w_out -> down_proj;
* RMSNorm eps = model.norm_eps; tied embeddings -> tie_word_embeddings;
* the vocabulary padding (model.vocab_pad_to) is trimmed: config.vocab_size = model.vocab_size
  (the tokenizer's size). The exported logits equal the framework's logits[..., :vocab_size];
  the padded rows never correspond to a token, so sampling and scoring over real tokens are
  unchanged (the framework's softmax also spans the padded entries, which training pushes
  towards zero probability, so per-token losses can differ in the last digits).

(Llama is chosen when every layer's attention and MLP kind declares a Llama mapping in
models.registry, as the softmax attention and dense MLP kinds do.) Every other model (softmax_sink /
relu / LISA attention, router MoE / UoE MLPs, in any mix) has no standard transformers architecture.
It is written with the self-contained modeling file models/hf/modeling_uoe_pretrain.py copied into
the folder (config.json maps AutoConfig and AutoModelForCausalLM to it), loaded with
`trust_remote_code=True`:

* parameter names and layouts are the framework's (prefix `model.`, `head` -> `lm_head`), except
  that each layer's experts are stacked: experts.w_in [N, 2 * D_e, d], experts.w_out [N, d, D_e];
* the same vocabulary trimming as above; the modeling file keeps a KV cache (except for relu
  "seqlen" models, whose earlier rows change as the sequence grows) and is dropless (a training
  capacity factor, if any, is not applied; export_info.json records it).

The folder is written to a temporary sibling and renamed into place at the end, so an error
never leaves a partial DIR.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import torch

from models import registry
from models.config import ModelConfig
from pretrain.checkpoint_format import EXPERT_KEY, read_meta, resolve_checkpoint
from pretrain.consolidate import describe_layout, full_state_dict, run_config, split_heads
from pretrain.data import starts_with_bos
from tools.cli import ToolError, argument_parser, check_out_dir, reports_errors, run


class ExportError(ToolError):
    pass


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REMOTE_CODE = Path(__file__).resolve().parent.parent / "models" / "hf" / "modeling_uoe_pretrain.py"


def export_format(cfg) -> str:
    """"llama" when every layer's kinds map onto Llama (dense softmax models), "remote" (the bundled
    modeling file) when it implements them all; ExportError naming the kinds otherwise."""
    if cfg.hidden_size % cfg.num_heads:
        raise ExportError(f"hidden_size {cfg.hidden_size} not divisible by num_heads {cfg.num_heads}")
    kinds = layer_kinds(cfg)
    if all(kind.llama is not None for kind in kinds):
        return "llama"
    unsupported = sorted({kind.name for kind in kinds if not kind.hf_remote})
    if unsupported:
        raise ExportError(
            f"kind(s) {unsupported} have no Hugging Face export: neither a Llama mapping nor the bundled "
            f"modeling file ({REMOTE_CODE.name}) implements them; python -m tools.consolidate writes the "
            "weights as one state dict instead")
    return "remote"


def layer_kinds(cfg) -> list:
    """The registered attention and MLP kind of every layer."""
    return [kind for i, attn in enumerate(cfg.attention_kinds())
            for kind in (registry.attention_kind(attn), registry.mlp_kind(cfg.mlp_kind(i)))]


def llama_config(cfg, dtype: torch.dtype, special: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=float(cfg.rope_base),
        rope_scaling=None,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=bool(cfg.tie_embeddings),
        initializer_range=cfg.init_std,
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
        pad_token_id=special["pad"],
        torch_dtype=dtype,
        architectures=["LlamaForCausalLM"],
    )


def to_llama_state(cfg, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Framework names/layouts (TP=1, full tensors) -> LlamaForCausalLM state dict; each layer's
    attention and MLP through their kinds' Llama mappings."""
    v = cfg.vocab_size
    out = {"model.embed_tokens.weight": state["embed.weight"][:v], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"][:v]
    for i, attn in enumerate(cfg.attention_kinds()):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        out.update(registry.attention_kind(attn).llama.to_llama(cfg, state, src + "attn.", dst + "self_attn."))
        out.update(registry.mlp_kind(cfg.mlp_kind(i)).llama.to_llama(cfg, state, src + "mlp.", dst + "mlp."))
        out[dst + "input_layernorm.weight"] = state[src + "attn_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "mlp_norm.weight"]
    return {k: t.contiguous().clone() for k, t in out.items()}


def remote_config(cfg, dtype: torch.dtype, special: dict):
    """The bundled modeling file's config for `cfg`, with auto_map pointing at that file."""
    from models.attention.lisa import lisa_sizes

    module = _remote_module()
    kinds = cfg.attention_kinds()
    rank, group, hidden = lisa_sizes(cfg)
    moe = cfg.moe
    name = REMOTE_CODE.stem
    return module.UoEPretrainConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.ffn_hidden_size,
        max_position_embeddings=cfg.max_seq_len, rope_theta=float(cfg.rope_base), rms_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std, attention_kinds=kinds,
        lisa_sources=[registry.score_source(kinds, i) if registry.attention_kind(k).reads_previous_scores else None
                      for i, k in enumerate(kinds)],
        relu_normalizer=cfg.relu_attention.normalizer, lisa_rank=rank, lisa_align_group=group,
        lisa_align_hidden=hidden, mlp_kinds=[cfg.mlp_kind(i) for i in range(cfg.num_layers)],
        num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        expert_hidden_size=moe.rest_neurons() if cfg.mlp == "uoe" else moe.expert_hidden_size,  # rest neurons
        shared_hidden_size=moe.shared_hidden_size,
        routing_neurons=moe.resolved_routing_neurons() if cfg.mlp == "uoe" else 0,
        uoe_score=moe.score, vse_mode=moe.vse_mode, tie_word_embeddings=bool(cfg.tie_embeddings),
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"], torch_dtype=dtype,
        architectures=["UoEPretrainForCausalLM"],
        auto_map={"AutoConfig": f"{name}.UoEPretrainConfig", "AutoModelForCausalLM": f"{name}.UoEPretrainForCausalLM"},
    )


@functools.cache
def _remote_module():
    """The modeling file imported on its own, as transformers will import it from the folder."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(REMOTE_CODE.stem, REMOTE_CODE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def to_remote_state(cfg, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Framework names (TP=1, full tensors) -> the modeling file's: `model.` prefix, `head` ->
    `lm_head`, the vocabulary trimmed, each layer's experts stacked into two tensors."""
    v = cfg.vocab_size
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = EXPERT_KEY.match(key)
        if key.endswith("_extra_state"):  # megatron-core layers' placeholders, not weights
            continue
        if match:  # blocks.I.mlp.experts.deepspeed_moe.experts.deepspeed_experts.E.w_in
            prefix = match.group(1).removesuffix("deepspeed_moe.experts.deepspeed_experts.")
            experts.setdefault((prefix, match.group(3).lstrip(".")), {})[int(match.group(2))] = tensor
        elif key == "head.weight":
            if not cfg.tie_embeddings:
                out["lm_head.weight"] = tensor[:v]
        else:
            out["model." + key] = tensor[:v] if key == "embed.weight" else tensor
    for (prefix, name), by_id in experts.items():
        if sorted(by_id) != list(range(cfg.moe.num_experts)):
            raise ExportError(f"{prefix}: expert ids {sorted(by_id)}, expected 0..{cfg.moe.num_experts - 1}")
        out[f"model.{prefix}{name}"] = torch.stack([by_id[e] for e in range(cfg.moe.num_experts)])
    return {k: t.contiguous().clone() for k, t in out.items()}


def run_path_places(configured: Path, tag_dir: Path) -> list[Path]:
    """Where a path in a run's config (data.tokenizer, data.shards) may be: a relative one from this
    directory, else from the directories above the run directory (a run is usually launched from
    one of them, e.g. the repository holding runs/ and data/)."""
    if configured.is_absolute():
        return [configured]
    run_dir = tag_dir.resolve().parent.parent  # RUN_DIR/checkpoints/<tag>
    return list(dict.fromkeys([Path.cwd() / configured, *(d / configured for d in run_dir.parents)]))


def find_tokenizer(tag_dir: Path, explicit: str | None, meta: dict, required: bool = True) -> Path | None:
    """The SentencePiece tokenizer directory: --tokenizer, else the run's data.tokenizer
    (run_path_places); checked against the checkpoint's tokenizer sha256. None when the run used
    no SentencePiece model (its checkpoint records none, as an import without --tokenizer), or
    when not `required` and it is not found."""
    from data_prep.tokenizer import MODEL_FILE, sha256_file

    want = meta.get("tokenizer_sha256")
    if explicit:
        path = Path(explicit)
        if not (path / MODEL_FILE).is_file():
            raise ExportError(f"--tokenizer {explicit}: no {MODEL_FILE} there")
    else:
        cfg = run_config(tag_dir)
        # No run config beside it, or a run without a tokenizer: an import without --tokenizer (those
        # written before they named none keep the default data.tokenizer, another model's)
        if cfg is None or not cfg.data.tokenizer or (not want and meta.get("imported_from")):
            if want and required:
                raise ExportError(f"{tag_dir} was trained with a SentencePiece tokenizer (sha256 {want[:12]}), but "
                                  + ("its run's config.yaml is not beside it" if cfg is None else
                                     "its run's config names no data.tokenizer") + "; pass --tokenizer DIR")
            return None
        places = run_path_places(Path(cfg.data.tokenizer), Path(tag_dir))
        found = [p for p in places if (p / MODEL_FILE).is_file()]
        # the first that is the checkpoint's own (another project's data/tokenizer may come first)
        own = next((p for p in found if sha256_file(p / MODEL_FILE) == want), None) if want else None
        if own is not None:
            return own
        path = found[0] if found else None
        if path is None:
            if want and required:  # the run trained with a SentencePiece model: not finding it is an error
                raise ExportError(f"the run's data.tokenizer={cfg.data.tokenizer}: no {MODEL_FILE} in "
                                  f"{', '.join(str(p) for p in places)}; pass --tokenizer DIR")
            return None
    got = sha256_file(path / MODEL_FILE)
    if want and want != got:
        raise ExportError(f"tokenizer {path / MODEL_FILE} (sha256 {got[:12]}) is not the one this checkpoint was "
                          f"trained with (sha256 {want[:12]}); pass --tokenizer with the run's tokenizer directory")
    check_tokenizer_fits(path, meta)
    return path


def check_tokenizer_fits(path: Path, meta: dict) -> None:
    """A tokenizer with ids past the model's vocabulary is another model's (a padded vocabulary may be
    larger than the tokenizer, never smaller)."""
    import sentencepiece as spm

    from data_prep.tokenizer import MODEL_FILE

    vocab = meta.get("model", {}).get("vocab_size")
    if vocab is None:
        return
    pieces = spm.SentencePieceProcessor(model_file=str(path / MODEL_FILE)).get_piece_size()
    if pieces > vocab:
        raise ExportError(f"tokenizer {path} has {pieces} tokens but the model's vocabulary has {vocab}: it is not "
                          "this model's tokenizer; pass --tokenizer with the run's tokenizer directory")


def run_tokenizer(tag_dir: Path, explicit: str | None, meta: dict):
    """The SentencePiece processor of find_tokenizer, for tools that cannot run without one."""
    from data_prep.tokenizer import load_tokenizer

    tokenizer_dir = find_tokenizer(tag_dir, explicit, meta)
    if tokenizer_dir is None:
        raise ExportError("the run has no SentencePiece tokenizer (data.tokenizer); pass --tokenizer DIR")
    return load_tokenizer(tokenizer_dir)[0]


def special_ids(tokenizer_dir: Path | None, meta: dict | None = None) -> dict:
    """{"unk", "bos", "eos", "pad"} ids: the tokenizer's; without one, those an imported model's config
    named (meta["special_ids"]), else the framework's defaults. A tokenizer without a pad piece
    (pad_id -1) gives pad None, which Hugging Face reads as "none"."""
    from data_prep.tokenizer import SPECIAL_IDS, load_tokenizer

    ids = {"unk": SPECIAL_IDS["unk_id"], "bos": SPECIAL_IDS["bos_id"], "eos": SPECIAL_IDS["eos_id"],
           "pad": SPECIAL_IDS["pad_id"]}
    if tokenizer_dir is not None:
        sp, _ = load_tokenizer(tokenizer_dir)
        ids = {"unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}
    elif meta and meta.get("special_ids"):  # an imported model's config: no pad unless it names one
        ids.update({"pad": None, **meta["special_ids"]})
    return {k: None if isinstance(v, int) and v < 0 else v for k, v in ids.items()}


# Strings the exported tokenizer must encode exactly as SentencePiece does before it is written.
TOKENIZER_PROBES = ("Hello world", "def main(x):\n    return x  # note", " leading space", "  two  spaces ",
                    "tab\there\n\nnewlines\n", "naïve café — ünïcode ✓ 🙂", "ﬁne Ｆｕｌｌ width", "x")


def hf_tokenizer(tokenizer_dir: Path, sp, meta: dict, add_bos: bool = False):
    """A LlamaTokenizerFast over the SentencePiece model `sp` of tokenizer_dir (its record `meta`) that
    encodes like it (ids only, no EOS added; BOS first with `add_bos`: a model trained with
    data.start_with_bos). Models of this framework have no dummy prefix; an imported one with
    Llama-2's dummy prefix gets Hugging Face's Llama-2 handling."""
    from transformers import LlamaTokenizerFast

    from data_prep.tokenizer import MODEL_FILE

    piece = sp.id_to_piece
    prefix = bool(meta.get("add_dummy_prefix", False))
    return LlamaTokenizerFast(
        vocab_file=str(tokenizer_dir / MODEL_FILE),
        unk_token=piece(sp.unk_id()), bos_token=piece(sp.bos_id()), eos_token=piece(sp.eos_id()),
        pad_token=piece(sp.pad_id()) if sp.pad_id() >= 0 else None,
        add_bos_token=add_bos, add_eos_token=False, legacy=prefix, add_prefix_space=prefix,
        clean_up_tokenization_spaces=False, model_max_length=None, from_slow=prefix,
    )


CHAT_PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 plus 3?"},
              {"role": "assistant", "content": "It is 6."}, {"role": "user", "content": "  And 4 plus 4?"}]


def chat_template_mismatch(tokenizer, encoder) -> str:
    """'' where the tokenizer's chat template gives the ids the model trained on (ChatEncoder's) for
    CHAT_PROBE, as a prompt and with a reply; else what differs."""
    reply = [*CHAT_PROBE, {"role": "assistant", "content": "8."}]
    for messages, generation, want in ((CHAT_PROBE, True, encoder.prompt(CHAT_PROBE)),
                                       (reply, False, encoder.conversation(reply)[0].tolist())):
        got = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
        got = list(got["input_ids"] if hasattr(got, "keys") else got)
        if got != want:
            return f"a {'prompt' if generation else 'conversation'} gives {got} where the model trained on {want}"
    return ""


def save_tokenizer(tokenizer_dir: Path, out: Path, add_bos: bool = False, padding_side: str = "right",
                   chat: dict | None = None) -> None:
    """hf_tokenizer's files in ``out``, loading with AutoTokenizer as PreTrainedTokenizerFast straight
    from tokenizer.json: LlamaTokenizerFast rebuilds itself from the SentencePiece model (which needs
    protobuf) whenever add_prefix_space is set, and the slow LlamaTokenizer needs that key. Checked
    against SentencePiece on TOKENIZER_PROBES as loaded back (raises ExportError on a difference).
    `padding_side`: left for a Llama export, whose batched generate() needs it (LlamaTokenizerFast's
    default, which the class name given here would not carry). `chat`: the chat format a post-trained
    model learnt (its meta's posttrain.chat), given as the tokenizer's chat_template."""
    from transformers import AutoTokenizer

    from data_prep.tokenizer import load_tokenizer
    from posttrain.chat import ChatEncoder, ChatFormat, chat_template

    sp, meta = load_tokenizer(tokenizer_dir)
    hf_tokenizer(tokenizer_dir, sp, meta, add_bos).save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_input_names"] = ["input_ids", "attention_mask"]  # no token_type_ids: generate() refuses them
    config["padding_side"] = padding_side
    # The shards hold "</s>" in text as its pieces, not as EOS: so does a tokenizer that splits special
    # tokens. A chat template writes BOS / EOS as text, which must stay special there.
    config["split_special_tokens"] = chat is None
    fmt = ChatFormat.recorded(chat) if chat is not None else None
    if fmt is not None:
        config["chat_template"] = chat_template(fmt, bool(meta.get("add_dummy_prefix")))

    def written():
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        return AutoTokenizer.from_pretrained(out)

    loaded = written()
    if fmt is not None:
        wrong = chat_template_mismatch(loaded, ChatEncoder(sp, fmt))
        if wrong:  # a template giving other ids than the model trained on is worse than none
            del config["chat_template"]
            loaded = written()
            print(f"note: the tokenizer gets no chat_template: rendered and tokenized at once, {wrong}; build "
                  "prompts with posttrain.chat.ChatEncoder and the format in export_info.json", flush=True)
    else:
        specials = " x".join(sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i))
        if loaded(f"a {specials} b", add_special_tokens=False)["input_ids"] != sp.encode(f"a {specials} b"):
            # A Unigram vocabulary holding those strings as pieces matches them whatever the flag says.
            config["split_special_tokens"] = False
            loaded = written()
            print(f"note: this tokenizer encodes the text of its special tokens ({specials.replace(' x', ', ')}) as "
                  "those tokens, where the training data held their pieces", flush=True)
    for text in TOKENIZER_PROBES:
        want, got = sp.encode(text), loaded(text, add_special_tokens=False)["input_ids"]
        if want != got:
            raise ExportError(
                f"the Hugging Face tokenizer cannot encode like {tokenizer_dir} (SentencePiece normalisation "
                f"{meta.get('normalization', 'identity')!r}, dummy prefix {meta.get('add_dummy_prefix', False)}): "
                f"{text!r} gives {got} where the model trained on {want}; pass --no-tokenizer to export the model "
                "without tokenizer files (and encode with the SentencePiece model)")


def write_folder(out: Path, cfg, state: dict, dtype: torch.dtype, tokenizer_dir: Path | None,
                 max_shard_size: str, extra_meta: dict) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    special = special_ids(tokenizer_dir, extra_meta)
    if extra_meta["format"] == "llama":
        config, model_class, hf_state = llama_config(cfg, dtype, special), LlamaForCausalLM, to_llama_state(cfg, state)
    else:
        config = remote_config(cfg, dtype, special)
        model_class = _remote_module().UoEPretrainForCausalLM
        hf_state = to_remote_state(cfg, state)
    # the routers' selection bias stays fp32, as training kept it (the modeling code selects in fp32)
    hf_state = {k: t.to(dtype) if t.is_floating_point() and not k.endswith("router_bias") else t
                for k, t in hf_state.items()}
    with torch.device("meta"):
        model = model_class(config)
    missing, unexpected = model.load_state_dict(hf_state, strict=False, assign=True)
    allowed = {"lm_head.weight"} if cfg.tie_embeddings else set()
    if unexpected or set(missing) - allowed:
        raise ExportError(f"internal mapping error: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=special["bos"], eos_token_id=special["eos"],
                                               pad_token_id=special["pad"], do_sample=True, temperature=1.0,
                                               top_p=1.0, top_k=0, max_length=cfg.max_seq_len)  # as tools.generate
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    if extra_meta["format"] == "remote":
        shutil.copy(REMOTE_CODE, out / REMOTE_CODE.name)
    (out / "export_info.json").write_text(json.dumps(extra_meta, indent=1, default=str))


def write_heads(out: Path, heads: dict, meta: dict, dtype: torch.dtype) -> None:
    """Each head beside the model: NAME.safetensors and NAME.json (its shape and how prompts are
    written for it, from the checkpoint's post-training record)."""
    from safetensors.torch import save_file

    for name, tensors in heads.items():
        save_file({k: t.to(dtype).contiguous() for k, t in tensors.items()}, str(out / f"{name}.safetensors"))
        record = meta.get("posttrain", {})
        info = {"head": name, **{k: record[k] for k in (name, "chat", "scores", "score_levels") if k in record}}
        (out / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")


def export(checkpoint: str, out: str | Path, dtype: str = "fp32", tokenizer: str | None = None,
           max_shard_size: str = "5GB", overwrite: bool = False, with_tokenizer: bool = True) -> Path:
    out = Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose {', '.join(DTYPES)}")
    check_out_dir(out, {})
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} exists and is not empty; choose a new directory or pass --overwrite")
    from huggingface_hub import split_torch_state_dict_into_shards

    try:  # a bad size fails here, not after the weights are read
        split_torch_state_dict_into_shards({}, max_shard_size=max_shard_size)
    except ValueError as err:
        raise ExportError(f"--max-shard-size {max_shard_size}: {err}") from None
    tag_dir = resolve_checkpoint(checkpoint)
    meta = read_meta(tag_dir)
    describe_layout(tag_dir, meta)  # a checkpoint that lacks files says so before anything else
    fmt = export_format(ModelConfig.from_dict(meta["model"]))
    tokenizer_dir = find_tokenizer(tag_dir, tokenizer, meta) if with_tokenizer else None
    check_out_dir(out, {"the checkpoint": tag_dir, "the tokenizer": tokenizer_dir})
    run_cfg = run_config(tag_dir)
    add_bos = bool(starts_with_bos(run_cfg, meta))  # as the model trained
    from pretrain.checkpoint import directory_in_place

    with directory_in_place(out) as tmp:
        if tokenizer_dir is not None:  # first: one Hugging Face cannot reproduce fails before the weights load
            # The bundled modeling file takes right padding only (it refuses padded generate()).
            save_tokenizer(tokenizer_dir, tmp, add_bos, "left" if fmt == "llama" else "right",
                           meta.get("posttrain", {}).get("chat"))
        write_model(tmp, tag_dir, fmt, dtype, tokenizer_dir, max_shard_size, add_bos)
    if tokenizer_dir is None and with_tokenizer:
        print("warning: the run trained without a SentencePiece tokenizer.model (data.tokenizer); exported the "
              "model without a tokenizer (pass --tokenizer DIR to add one)", file=sys.stderr)
    return out


def write_model(out: Path, tag_dir: Path, fmt: str, dtype: str, tokenizer_dir: Path | None, max_shard_size: str,
                add_bos: bool) -> None:
    """The checkpoint's weights (and heads) in Hugging Face's layout, with export_info.json."""
    state, cfg, meta = full_state_dict(tag_dir)
    heads = split_heads(state, meta.get("heads", []))
    chat = meta.get("posttrain", {}).get("chat")  # the chat format a post-trained model learnt
    info = {"checkpoint": str(tag_dir), "step": meta.get("step"), "layout": meta["layout"], "format": fmt,
            "model": meta["model"], "dtype": dtype, "vocab_padding_trimmed": cfg.padded_vocab_size - cfg.vocab_size,
            "tokenizer": str(tokenizer_dir) if tokenizer_dir else None, "special_ids": meta.get("special_ids"),
            "add_bos_token": add_bos, **({"chat": chat} if chat else {})}
    if fmt == "remote" and registry.mlp_kind(cfg.mlp).routed and cfg.moe.capacity_factor > 0:
        info["capacity_factor_dropped"] = cfg.moe.capacity_factor
        print(f"note: the run used model.moe.capacity_factor={cfg.moe.capacity_factor}; the exported model "
              "routes every token (dropless), as inference does", file=sys.stderr)
    write_folder(out, cfg, state, DTYPES[dtype], tokenizer_dir, max_shard_size, info)
    write_heads(out, heads, meta, DTYPES[dtype])


@reports_errors()
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", required=True, help="RUN_DIR (newest complete) or RUN_DIR/checkpoints/TAG")
    parser.add_argument("--out", required=True, help="output folder (must be new or empty)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--tokenizer", default=None, help="SentencePiece tokenizer dir (default: the run's)")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size, e.g. 2GB")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="write no tokenizer files (the model and its config only)")
    args = parser.parse_args(argv)
    out = export(args.checkpoint, args.out, args.dtype, args.tokenizer, args.max_shard_size, args.overwrite,
                 with_tokenizer=not args.no_tokenizer)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
