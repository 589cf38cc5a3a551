"""Hugging Face export / import and the single-process tools, on real checkpoints:

* tiny dense runs at TP=2 x DP=2 (ZeRO-2 and ZeRO-3) -> export -> LlamaForCausalLM logits equal the
  framework's logits of the consolidated weights; the exported tokenizer encodes like SentencePiece;
* a UoE run at EP=2 and a hybrid-attention MoE run at TP=2 -> export with the bundled modeling file
  -> AutoModelForCausalLM(trust_remote_code) logits equal the framework's, also in a process that
  cannot import the framework;
* a random LlamaForCausalLM -> import -> same logits -> export -> same logits again; the imported
  checkpoint resumes training;
* evaluate reproduces the trainer's validation loss; generate's greedy ids equal HF generate's;
  lm-evaluation-harness scores an export as pretrain.downstream scores the checkpoint;
* bad inputs fail with clear errors and write nothing.
"""

from __future__ import annotations

import json
import os
import math
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.dist_utils import REPO, child_env, single_process_group, train
from tests.synthetic import tiny_overrides, write_synthetic_shards

STEPS = 2
SAMPLE = "def add(a, b):\n    return a + b  # sum\n\nclass Tree:\n\tpass\nnaïve café — ünïcode ✓ 🙂 \n  x"


def corpus_text() -> str:
    lines = []
    for i in range(400):
        lines.append(f"def function_{i % 37}(value, other):\n    return value * {i} + other  # note {i % 11}\n")
        lines.append(f"class Thing{i % 13}:\n    name = 'item {i}'\n")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def dist_env():
    """This process as a single-process gloo group (consolidation builds the model at TP=1)."""
    with single_process_group():
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Synthetic shards whose tokenizer is a real (tiny) SentencePiece model."""
    from data_prep.tokenizer import META_FILE, MODEL_FILE
    from data_prep.train_tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("data")
    (root / "corpus").mkdir()
    (root / "corpus" / "code.txt").write_text(corpus_text())
    meta = train_tokenizer([root / "corpus"], root / "real_tokenizer", vocab_size=300, num_threads=1)
    vocab = meta["vocab_size"]
    write_synthetic_shards(root, vocab_size=vocab)
    for name in (MODEL_FILE, META_FILE):
        shutil.copy(root / "real_tokenizer" / name, root / "tokenizer" / name)
    manifest = json.loads((root / "shards" / "manifest.json").read_text())
    manifest["tokenizer_sha256"] = meta["sha256"]
    (root / "shards" / "manifest.json").write_text(json.dumps(manifest))
    return root, vocab


def train_run(root, run, settings: dict, nproc: int = 2) -> str:
    proc = train(nproc, tiny_overrides(root, run, **settings))
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """Two 4-process runs, one after the other (streaming clears all of its shared memory when a run
    starts, so concurrent runs would break each other): TP=2 x DP=2 with ZeRO-2 and with ZeRO-3."""
    root, vocab = data
    base = tmp_path_factory.mktemp("runs")
    layouts = {"tp2_zero2": {"parallel.tensor": 2, "parallel.zero_stage": 2},
               "tp2_zero3": {"parallel.tensor": 2, "parallel.zero_stage": 3}}
    for name, extra in layouts.items():
        settings = {"model.vocab_size": vocab, "train.steps": STEPS, "train.warmup_steps": 1,
                    "train.eval_interval": STEPS, "train.save_interval": STEPS, "train.eval_batches": 1,
                    "eval.sample_prompts": '["def function_3("]', "eval.sample_tokens": 6, **extra}
        train_run(root, base / name, settings, nproc=4)
    return {name: base / name for name in layouts}


def val_loss_logged(run, step: int) -> float:
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("step") == step and "val/loss" in record:
            return record["val/loss"]
    raise AssertionError(f"no val/loss at step {step} in {run / 'metrics.jsonl'}")


def framework_logits(checkpoint, tokens: torch.Tensor) -> torch.Tensor:
    from pretrain.consolidate import load_model

    model, cfg, _ = load_model(checkpoint)
    with torch.no_grad():
        return model.logits(tokens)[..., : cfg.vocab_size]


def hf_logits(folder, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def fixed_tokens(vocab: int, batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_a_consolidated_file_keeps_its_run_s_tokenizer_for_init_from(runs, dist_env, tmp_path):
    """train.init_from refuses a checkpoint of another tokenizer; the weights file tools.consolidate
    writes of it records the tokenizer, so it is refused the same way."""
    from pretrain.checkpoint_format import CheckpointError, read_meta, resolve_checkpoint
    from pretrain.init_from import check_source
    from tools.consolidate import main as consolidate

    tag = resolve_checkpoint(runs["tp2_zero2"])
    meta = read_meta(tag)
    assert consolidate(["--checkpoint", str(tag), "--out", str(tmp_path / "w.pt")]) == 0
    assert check_source(str(tmp_path / "w.pt"), meta["model"], meta["tokenizer_sha256"]) == tmp_path / "w.pt"
    for source in (str(tag), str(tmp_path / "w.pt")):
        with pytest.raises(CheckpointError, match="trained with another tokenizer"):
            check_source(source, meta["model"], "f" * 64)
        # Another sequence length: the weights do not depend on it (a longer context from them)
        longer = {**meta["model"], "max_seq_len": 2 * meta["model"]["max_seq_len"]}
        assert str(check_source(source, longer, meta["tokenizer_sha256"])) == source
        with pytest.raises(CheckpointError, match="hidden_size: checkpoint"):
            check_source(source, {**longer, "hidden_size": 2 * meta["model"]["hidden_size"]}, None)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_zero2", "tp2_zero3"])
def test_export_logits_match_framework(runs, data, dist_env, tmp_path, layout):
    from tools.export import main as export_main

    _, vocab = data
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(runs[layout]), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == vocab
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    assert (out / "tokenizer.model").is_file() and (out / "tokenizer.json").is_file()
    from transformers import AutoTokenizer, GenerationConfig

    assert AutoTokenizer.from_pretrained(out).padding_side == "left"  # batched generate() of shorter prompts

    sampling = GenerationConfig.from_pretrained(out)  # tools.generate's: the whole vocabulary, no top-k cut
    assert (sampling.do_sample, sampling.temperature, sampling.top_p, sampling.top_k) == (True, 1.0, 1.0, 0)
    from tools.import_hf import hf_starts_with_bos  # what importing it back would set data.start_with_bos to

    assert hf_starts_with_bos(out, config) == (False, "its tokenizer does not begin a text with BOS")
    tokens = fixed_tokens(vocab)
    ours, theirs = framework_logits(runs[layout], tokens), hf_logits(out, tokens)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert ours.std() > 0.05  # a real model, not zeros


def test_consolidation_reads_the_layout_of_the_checkpoint_not_of_the_run(runs, data, dist_env, tmp_path):
    """config.yaml follows the run's latest start: after a resume at TP=1 it says parallel.tensor: 1,
    while this checkpoint was saved at TP=2."""
    import yaml

    _, vocab = data
    run = tmp_path / "run"
    shutil.copytree(runs["tp2_zero2"], run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["parallel"]["tensor"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    tokens = fixed_tokens(vocab)
    torch.testing.assert_close(framework_logits(run, tokens), framework_logits(runs["tp2_zero2"], tokens))


@pytest.mark.slow
def test_export_bf16_and_sharded(runs, data, dist_env, tmp_path):
    from tools.export import main as export_main

    _, vocab = data
    out = tmp_path / "hf16"
    assert export_main(["--checkpoint", str(runs["tp2_zero2"]), "--out", str(out), "--dtype", "bf16",
                        "--max-shard-size", "100KB", "--no-tokenizer"]) == 0
    assert not list(out.glob("tokenizer*"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tokens = fixed_tokens(vocab)
    diff = (framework_logits(runs["tp2_zero2"], tokens) - hf_logits(out, tokens)).abs().max().item()
    assert 0 < diff < 0.05  # bf16 weights: close, not identical


def test_exported_tokenizer_encodes_like_sentencepiece(data, tmp_path, monkeypatch):
    import transformers.tokenization_utils_fast as fast_module
    from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerFast

    from data_prep.tokenizer import load_tokenizer
    from tools.export import save_tokenizer

    root, _ = data
    sp, _ = load_tokenizer(root / "tokenizer")
    out = tmp_path / "tok"
    save_tokenizer(root / "tokenizer", out)
    want = sp.encode(SAMPLE)
    assert 3 not in want and len(want) > 20

    def no_conversion(*args, **kwargs):
        raise AssertionError("AutoTokenizer rebuilt the fast tokenizer from the SentencePiece model (needs protobuf)")

    with monkeypatch.context() as m:  # lm-eval loads with AutoTokenizer: tokenizer.json as it is
        m.setattr(fast_module, "convert_slow_tokenizer", no_conversion)
        fast = AutoTokenizer.from_pretrained(out)
    assert isinstance(fast, PreTrainedTokenizerFast)
    slow = LlamaTokenizer.from_pretrained(out)
    for tok in (fast, slow):
        assert tok(SAMPLE)["input_ids"] == want, type(tok).__name__
        assert tok(" leading space")["input_ids"] == sp.encode(" leading space")
        # the text of a special token, as the shards hold it: its pieces, not the token (lm-eval scores such text)
        assert tok("a </s> b <unk>")["input_ids"] == sp.encode("a </s> b <unk>"), type(tok).__name__
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 3, 0)
    assert fast.decode(want) == SAMPLE
    assert "token_type_ids" not in fast(SAMPLE)  # generate(**tok(text)) takes every key
    save_tokenizer(root / "tokenizer", tmp_path / "bos", add_bos=True)  # trained with data.start_with_bos
    assert AutoTokenizer.from_pretrained(tmp_path / "bos")(SAMPLE)["input_ids"] == [1] + want


def test_imported_tokenizers_export_exactly_or_not_at_all(tmp_path):
    """Llama-2's conventions (dummy prefix, identity normalisation, whitespace kept) export to a
    tokenizer that encodes like SentencePiece; an nmt_nfkc model, which Hugging Face's fast tokenizer
    does not reproduce, is refused by name; a folder holding a Hugging Face tokenizer.json instead of
    this framework's record says how to import it."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from data_prep.import_tokenizer import import_tokenizer
    from data_prep.tokenizer import load_tokenizer
    from tools.export import ExportError, save_tokenizer, special_ids

    (tmp_path / "corpus.txt").write_text(corpus_text() + "\n" + SAMPLE)
    for name, normalisation in (("llama2", "identity"), ("nfkc", "nmt_nfkc")):
        spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / name),
                                       vocab_size=300, model_type="unigram", pad_id=-1, byte_fallback=True,
                                       normalization_rule_name=normalisation, remove_extra_whitespaces=False,
                                       minloglevel=2)
        import_tokenizer(tmp_path / f"{name}.model", tmp_path / f"{name}_tok")
    sp, _ = load_tokenizer(tmp_path / "llama2_tok")
    save_tokenizer(tmp_path / "llama2_tok", tmp_path / "llama2_hf")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "llama2_hf")
    for text in (SAMPLE, "Hello world", " two  spaces"):
        assert loaded(text)["input_ids"] == sp.encode(text), text
    assert special_ids(tmp_path / "llama2_tok")["pad"] is None  # no pad piece: not -1
    # A chat model of it: SentencePiece gave every piece ChatEncoder encodes a space of its own, which
    # the chat template writes where running text has none (not at the start, not after BOS / EOS).
    import dataclasses

    from posttrain.chat import ChatEncoder, ChatFormat, chat_template
    from tools.export import chat_template_mismatch

    for fmt in (ChatFormat(add_bos=True), ChatFormat(prefix_spaces_in_response=False)):
        save_tokenizer(tmp_path / "llama2_tok", tmp_path / "llama2_chat", add_bos=fmt.add_bos,
                       chat=dataclasses.asdict(fmt))
        chat = AutoTokenizer.from_pretrained(tmp_path / "llama2_chat")
        assert chat.chat_template and chat_template_mismatch(chat, ChatEncoder(sp, fmt)) == "", fmt
        chat.chat_template = chat_template(fmt)  # as if it had no dummy prefix: other ids, and told so
        assert "where the model trained on" in chat_template_mismatch(chat, ChatEncoder(sp, fmt))
    # tools.generate prints the continuation with the space a dummy prefix strips from text decoded alone
    from data_prep.tokenizer import continuation_text

    ids = sp.encode("def main(x): return x")
    cut = next(i for i in range(1, len(ids)) if sp.id_to_piece(ids[i]).startswith("\u2581"))
    assert sp.decode(ids[cut:])[0] != " " and continuation_text(sp, ids[:cut], ids[cut:])[0] == " "
    assert sp.decode(ids[:cut]) + continuation_text(sp, ids[:cut], ids[cut:]) == sp.decode(ids)
    with pytest.raises(ExportError, match="cannot encode like .*nmt_nfkc.*--no-tokenizer"):
        save_tokenizer(tmp_path / "nfkc_tok", tmp_path / "nfkc_hf")
    with pytest.raises(ValueError, match="not this framework's tokenizer record.*data_prep.import_tokenizer"):
        load_tokenizer(tmp_path / "llama2_hf")


@pytest.mark.slow
def test_evaluate_matches_trainer_validation(runs, dist_env, data, capsys, tmp_path):
    from tools.evaluate import main as evaluate_main

    root, _ = data
    # The trainer validates on train.eval_batches=1 x micro_batch=4 samples per data-parallel rank:
    # samples 0-7 at DP=2 (rank r reading samples r, r+2, ...).
    for layout, batches in (("tp2_zero2", 2), ("tp2_zero3", 2)):
        assert evaluate_main(["--checkpoint", str(runs[layout]), "--shards", str(root / "shards"), "--batches",
                              str(batches), "--batch-size", "4", "--json"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["step"] == STEPS and result["tokens"] == batches * 4 * 32
        assert result["loss"] == pytest.approx(val_loss_logged(runs[layout], STEPS), abs=1e-4), layout
        assert 0 < result["loss"] < 7 and result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    # More batches than the split holds (16 samples): its full batches only, as the trainer validates
    assert evaluate_main(["--checkpoint", str(runs["tp2_zero2"]), "--shards", str(root / "shards"), "--batches",
                          "9", "--batch-size", "3", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["tokens"] == 15 * 32
    assert "holds 16 samples, fewer than --batches x --batch-size: 15 of them are read, in batches of 3" in out.err
    # Shards of another tokenizer (same vocabulary size): refused before the model is read.
    other = tmp_path / "other_shards"
    shutil.copytree(root / "shards" / "val", other / "val")
    manifest = json.loads((root / "shards" / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": "f" * 64}))
    assert evaluate_main(["--checkpoint", str(runs["tp2_zero2"]), "--shards", str(other)]) == 2
    assert "tokenized with another tokenizer (sha256 ffffffffffff)" in capsys.readouterr().err
    assert evaluate_main(["--checkpoint", str(runs["tp2_zero2"]), "--shards", str(root / "shards"),
                          "--tokenizer", str(tmp_path / "nope")]) == 2  # it would have been ignored
    assert "--tokenizer " + str(tmp_path / "nope") + " encodes --tasks, which are not given" in capsys.readouterr().err


def test_a_checkpoint_away_from_its_run_begins_with_bos_as_its_marker_records(runs, tmp_path):
    """The readers take data.start_with_bos and data.document_mask from the run's config.yaml, else
    from the checkpoint's marker (written since it records them), so a copied checkpoint still
    prompts with BOS and is measured within documents."""
    from pretrain.checkpoint_format import read_meta, resolve_checkpoint
    from pretrain.data import run_bos, run_document_eos

    meta = read_meta(resolve_checkpoint(runs["tp2_zero2"]))
    assert meta["start_with_bos"] is False and run_bos(None, meta) is None
    assert run_bos(None, {**meta, "start_with_bos": True}) == meta["bos_id"]
    assert run_bos(None, {k: v for k, v in meta.items() if k != "start_with_bos"}) is None  # older markers
    # data.document_mask too: tools.evaluate's loss on a copied checkpoint is the run's
    assert meta["document_mask"] is False and run_document_eos(None, meta) is None
    assert run_document_eos(None, {**meta, "document_mask": True, "eos_id": 7}) == 7


def test_a_relative_tokenizer_path_is_found_from_the_directories_above_the_run(tmp_path, monkeypatch):
    """A run launched from its project directory (data.tokenizer: tok) and read from elsewhere."""
    import tools.export as export
    from data_prep.tokenizer import sha256_file
    from pretrain.config import Config

    tag = tmp_path / "project" / "runs" / "r" / "checkpoints" / "step_00000001"
    tag.mkdir(parents=True)
    (tmp_path / "project" / "tok").mkdir()
    (tmp_path / "project" / "tok" / "tokenizer.model").write_bytes(b"pieces")
    run = Config()
    run.data.tokenizer = "tok"
    monkeypatch.setattr(export, "run_config", lambda tag_dir: run)
    monkeypatch.chdir(tmp_path)
    meta = {"tokenizer_sha256": sha256_file(tmp_path / "project" / "tok" / "tokenizer.model")}
    assert export.find_tokenizer(tag, None, meta) == tmp_path / "project" / "tok"
    (tmp_path / "tok").mkdir()  # another tokenizer where the tool runs: passed over for the run's own
    (tmp_path / "tok" / "tokenizer.model").write_bytes(b"other pieces")
    assert export.find_tokenizer(tag, None, meta) == tmp_path / "project" / "tok"
    (tmp_path / "tok" / "tokenizer.model").unlink()
    (tmp_path / "project" / "tok" / "tokenizer.model").unlink()
    with pytest.raises(export.ExportError, match=f"data.tokenizer=tok: no tokenizer.model in {tmp_path / 'tok'}, "):
        export.find_tokenizer(tag, None, meta)  # the run trained with one: an error, not an export without it
    assert export.find_tokenizer(tag, None, meta, required=False) is None  # generate --prompt-ids
    assert export.find_tokenizer(tag, None, {}) is None  # a run without one recorded
    # A run that names none (an import without --tokenizer) never takes one found on the way, nor
    # does an import that kept the default data.tokenizer (written before imports named none).
    (tmp_path / "tok" / "tokenizer.model").write_bytes(b"other pieces")
    assert export.find_tokenizer(tag, None, {"imported_from": "hf/model"}) is None
    run.data.tokenizer = ""
    assert export.find_tokenizer(tag, None, {}) is None
    with pytest.raises(export.ExportError, match="sha256 .* config names no data.tokenizer; pass --tokenizer DIR"):
        export.find_tokenizer(tag, None, meta)
    # A checkpoint copied out of its run: its config.yaml is not there to say where the tokenizer is.
    monkeypatch.setattr(export, "run_config", lambda tag_dir: None)
    with pytest.raises(export.ExportError, match="config.yaml is not beside it; pass --tokenizer DIR"):
        export.find_tokenizer(tag, None, meta)
    assert export.find_tokenizer(tag, None, meta, required=False) is None


def test_a_tokenizer_with_more_tokens_than_the_model_is_refused(data, tmp_path):
    """Its ids past the vocabulary would index outside the embedding: another model's tokenizer."""
    import tools.export as export

    root, vocab = data
    assert export.find_tokenizer(tmp_path, str(root / "tokenizer"), {"model": {"vocab_size": vocab + 64}}) \
        == root / "tokenizer"  # a padded vocabulary is larger than its tokenizer
    with pytest.raises(export.ExportError, match=f"has {vocab} tokens but the model's vocabulary has {vocab - 1}"):
        export.find_tokenizer(tmp_path, str(root / "tokenizer"), {"model": {"vocab_size": vocab - 1}})


@pytest.mark.slow
def test_generate_cli_greedy_equals_hf_generate(runs, data, dist_env, tmp_path, capsys):
    from transformers import LlamaForCausalLM

    from data_prep.tokenizer import load_tokenizer
    from models.generation import generate
    from pretrain.consolidate import load_model
    from tools.export import main as export_main

    root, vocab = data
    run = runs["tp2_zero3"]
    proc = subprocess.run([sys.executable, "-m", "tools.generate", "--checkpoint", str(run), "--prompt",
                           "def function_3(", "--greedy", "--max-new-tokens", "6", "--json"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    sp, _ = load_tokenizer(root / "tokenizer")
    assert result["prompt_ids"] == sp.encode("def function_3(")
    assert 1 <= len(result["ids"]) <= 6 and all(0 <= t < vocab for t in result["ids"])
    assert result["text"] == sp.decode(result["ids"])
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(run), "--out", str(out)]) == 0
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.tensor([result["prompt_ids"]])
    ids = hf.generate(prompt, do_sample=False, max_new_tokens=6)[0, prompt.shape[1]:].tolist()
    assert ids == result["ids"]
    # eval.sample_prompts: the run's own greedy sample at its last evaluation, at TP=2 x DP=2, the same
    for layout in runs:
        [sample] = [r["samples/0"] for r in map(json.loads, (runs[layout] / "metrics.jsonl").read_text().splitlines())
                    if "samples/0" in r and r["step"] == STEPS]
        assert sample == result["text"], layout
    # A run trained with data.start_with_bos: the prompt begins with BOS, as its samples did.
    bos_run = tmp_path / "bos_run"
    shutil.copytree(run, bos_run)
    (bos_run / "config.yaml").write_text((bos_run / "config.yaml").read_text().replace(
        "start_with_bos: false", "start_with_bos: true"))
    proc = subprocess.run([sys.executable, "-m", "tools.generate", "--checkpoint", str(bos_run), "--prompt",
                           "def function_3(", "--greedy", "--max-new-tokens", "2", "--json", "--device", "cpu"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["prompt_ids"] == [1] + sp.encode("def function_3(")
    model, _, _ = load_model(run)  # sampling: valid ids, reproducible with a seed, top-p restricts
    draws = [generate(model, [5, 6], 8, temperature=1.5, top_p=0.9, eos_id=None,
                      generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert draws[0] == draws[1] and len(draws[0]) == 8 and all(0 <= t < vocab for t in draws[0] + draws[2])
    from tools.generate import main as generate_main

    assert generate_main(["--checkpoint", str(tmp_path / "no_run"), "--prompt-ids", "5,x"]) == 2  # read first
    assert "--prompt-ids '5,x': give comma-separated token ids" in capsys.readouterr().err
    tiny_p = generate(model, [5, 6], 4, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(3))
    assert tiny_p == generate(model, [5, 6], 4, greedy=True)


LLAMA = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 5000.0}


@pytest.fixture(scope="module")
def imported(data, dist_env, tmp_path_factory):
    """A random grouped-query-attention LlamaForCausalLM (2 K/V heads for 4 query heads), saved
    and imported: (source model, imported run directory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.import_hf import main as import_main

    _, vocab = data
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, bos_token_id=vocab - 2,
                                          eos_token_id=vocab - 1, pad_token_id=vocab - 3, **LLAMA)).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in source.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    base = tmp_path_factory.mktemp("imported")
    source.save_pretrained(base / "src")
    # Its shards here come from another tokenizer, whose BOS is not the model's: no BOS, as they were built.
    assert import_main(["--model", str(base / "src"), "--out", str(base / "run"), "--start-with-bos", "false"]) == 0
    return source, base / "run"


def test_a_tied_llama_imports_and_exports_tied(data, dist_env, tmp_path):
    """tie_word_embeddings: one embedding matrix as the head too, through import and export."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pretrain.config import load_config
    from pretrain.consolidate import full_state_dict
    from tools.export import main as export_main
    from tools.import_hf import main as import_main

    _, vocab = data
    torch.manual_seed(1)
    source = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, tie_word_embeddings=True, **LLAMA)).eval()
    source.save_pretrained(tmp_path / "src")
    assert import_main(["--model", str(tmp_path / "src"), "--out", str(tmp_path / "run"),
                        "--start-with-bos", "false"]) == 0
    assert load_config(tmp_path / "run" / "config.yaml").model.tie_embeddings is True
    state, _, _ = full_state_dict(tmp_path / "run")
    assert "head.weight" not in state
    tokens = fixed_tokens(vocab)
    with torch.no_grad():
        want = source(tokens).logits
    assert (framework_logits(tmp_path / "run", tokens) - want).abs().max().item() <= 1e-4
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"] is True
    assert (hf_logits(tmp_path / "back", tokens) - want).abs().max().item() <= 1e-4


def test_import_round_trip_and_resume(data, imported, dist_env, tmp_path):
    from tools.export import main as export_main

    root, vocab = data
    source, run = imported
    back = tmp_path / "back"
    tag = run / "checkpoints" / "step_00000000"
    assert (tag / "COMPLETE").is_file() and (run / "config.yaml").is_file()
    # No tokenizer in the folder, a bos_token_id in its config: by default its texts begin with BOS, as
    # Llama's do, the id its config names (imported here with --start-with-bos false).
    from pretrain.checkpoint_format import read_meta
    from pretrain.config import load_config
    from pretrain.data import run_bos
    from tools.import_hf import hf_starts_with_bos, read_hf_config

    src = run.parent / "src"  # the saved Hugging Face folder
    assert hf_starts_with_bos(src, read_hf_config(src)) == (True, f"its config names bos_token_id {vocab - 2} "
                                                                  "(no tokenizer in the folder)")
    cfg = load_config(run / "config.yaml")
    assert cfg.data.start_with_bos is False and run_bos(cfg, read_meta(tag)) is None
    assert cfg.data.tokenizer == ""  # imported without --tokenizer: names none
    cfg.data.start_with_bos = True
    assert read_meta(tag)["bos_id"] == vocab - 2 and run_bos(cfg, {"special_ids": {"bos": vocab - 2}}) == vocab - 2
    tokens = fixed_tokens(vocab)
    with torch.no_grad():
        want = source(tokens).logits
    assert (framework_logits(tag, tokens) - want).abs().max().item() <= 1e-4
    from pretrain.consolidate import load_model

    model, model_cfg, _ = load_model(tag)  # the padded vocabulary rows start at zero: their logits are 0
    assert model_cfg.padded_vocab_size > vocab
    state = model.state_dict()
    assert not state["embed.weight"][vocab:].any() and not state["head.weight"][vocab:].any()
    umask = os.umask(0o022)
    try:
        assert export_main(["--checkpoint", str(run), "--out", str(back)]) == 0
    finally:
        os.umask(umask)
    # Readable by others as the umask allows (not mkdtemp's 0700 and safetensors' 0600), for shared
    # disks; the imported run directory too (written under the suite's umask).
    assert back.stat().st_mode & 0o777 == 0o755 and run.stat().st_mode & 0o777 == 0o777 & ~umask
    assert {oct(p.stat().st_mode & 0o777) for p in back.iterdir()} == {"0o644"}
    assert (hf_logits(back, tokens) - want).abs().max().item() <= 1e-4
    # Grouped-query attention is kept, not expanded: the same K/V heads and parameter count both ways.
    assert "num_kv_heads: 2" in (run / "config.yaml").read_text()
    config = json.loads((back / "config.json").read_text())
    assert config["num_key_value_heads"] == 2
    # Without a tokenizer the source config's special ids carry over (not the framework's 1/2/3).
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (vocab - 2, vocab - 1, vocab - 3)
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(back, dtype=torch.float32)
    assert sum(p.numel() for p in exported.parameters()) == sum(p.numel() for p in source.parameters())
    # The imported checkpoint resumes as pretrain.train does it: config and checkpoint checks, a
    # fresh engine loads weights (optimizer fresh), and a training step runs.
    from models.gpt import GPT
    from pretrain import checkpoint
    from pretrain.config import load_config
    from pretrain.engine import build_engine
    from pretrain.train import prepare

    cfg = load_config(run / "config.yaml", [f"data.shards={root / 'shards'}", f"data.tokenizer={root / 'tokenizer'}",
                                            f"train.resume={tag}", "train.micro_batch=2", "train.steps=30"])
    _, resume_path, _, universal = prepare(cfg, 1)
    assert universal is False
    assert resume_path == tag
    torch.manual_seed(1)
    engine = build_engine(cfg, GPT(cfg.model))
    checkpoint.load(engine, tag)
    from pretrain.consolidate import load_model

    imported, _, _ = load_model(tag)
    for (name, p), q in zip(engine.module.named_parameters(), imported.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    batch = torch.randint(4, vocab, (2, 33), generator=torch.Generator().manual_seed(2))
    engine.train()
    # Two steps at the warmup rates of a fresh run (the schedule is at step 0).
    for _ in range(2):
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)
    assert engine.global_steps == 2 and engine.get_lr()[0] > 0
    assert not torch.equal(engine.module.blocks[0].attn.qkv.weight.detach(), imported.blocks[0].attn.qkv.weight)
    # At ZeRO-0 in bf16 DeepSpeed's optimizer keeps fp32 masters of the weights: they are the
    # imported ones too, so a step moves from them (it went back to the fresh initialisation).
    bf16 = load_config(run / "config.yaml", [f"data.shards={root / 'shards'}", f"data.tokenizer={root / 'tokenizer'}",
                                             f"train.resume={tag}", "train.micro_batch=2", "train.steps=30",
                                             "parallel.zero_stage=0", "train.precision=bf16", "train.lr=1e-5"])
    assert prepare(bf16, 1)[1:] == (tag, None, False)
    torch.manual_seed(3)
    engine = build_engine(bf16, GPT(bf16.model))
    checkpoint.load(engine, tag)
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()
    moved = engine.module.blocks[0].attn.qkv.weight.detach().float() - imported.blocks[0].attn.qkv.weight.float()
    assert moved.abs().max() < 0.01


def test_imported_llama_converts_to_lisa(data, imported, dist_env, tmp_path, capsys):
    """An imported grouped-query Llama: layer 1 converted by measured sensitivity with its own
    Q/K at full rank (head_dim 16) computes what the source computes, so the validation loss
    before any training is the source's."""
    from tools.convert_lisa import main as convert_main

    root, _ = data
    _, run = imported
    assert convert_main(["--checkpoint", str(run), "--layers", "sensitivity", "--calib-shards",
                         str(root / "shards"), "--out", str(tmp_path / "lisa"), "--steps", "1", "--rank", "16",
                         "--keep-full-layers", "1", "--loss-budget", "1e-6", "--calib-batches", "1",
                         "--val-samples", "8"]) == 0
    assert ("note: one alignment group of all 4 heads, so the converted model runs at parallel.tensor=1 only; "
            "--align-group G (a divisor of 4)") in capsys.readouterr().out
    report = json.loads((tmp_path / "lisa" / "conversion.json").read_text())
    assert report["layers"] == [1] and report["qk_init"] == "own" and set(report["sensitivity"]) == {"1"}
    assert report["val_loss"]["converted_init"] == pytest.approx(report["val_loss"]["source"], rel=1e-5)
    # Q (64 x 64) and the grouped K (32 x 64) of the replaced layer against 4 heads x 2 x 16 x 64.
    assert report["qk_params"]["replaced_layers_source"] == 64 * (64 + 32)
    assert report["qk_params"]["replaced_layers_lisa"] == 4 * 2 * 16 * 64


@pytest.mark.slow
def test_bad_inputs_fail_clearly_and_write_nothing(runs, imported, dist_env, tmp_path, capsys):
    from tools.consolidate import main as consolidate_main
    from tools.convert_experts import main as convert_experts_main
    from tools.export import main as export_main
    from tools.import_hf import main as import_main

    def export_fails(checkpoint, *needles):
        out = tmp_path / f"out_{time.monotonic_ns()}"
        assert export_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        for needle in needles:
            assert needle in err, err
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out_")]  # no temporary leftovers

    src = runs["tp2_zero2"] / "checkpoints" / "step_00000002"
    partial = tmp_path / "partial" / "checkpoints" / "step_00000002"
    shutil.copytree(src, partial)
    (partial / "COMPLETE").unlink()
    export_fails(partial, "no COMPLETE marker")
    missing = tmp_path / "missing" / "checkpoints" / "step_00000002"
    shutil.copytree(src, missing)
    (missing / "mp_rank_01_model_states.pt").unlink()
    export_fails(missing, "missing 1 file", "mp_rank_01_model_states.pt")
    z3 = runs["tp2_zero3"] / "checkpoints" / "step_00000002"
    z3_missing = tmp_path / "z3" / "checkpoints" / "step_00000002"
    shutil.copytree(z3, z3_missing)
    (z3_missing / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (z3_missing / "rank_00001.pt").unlink()
    export_fails(z3_missing, "missing 2 file", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "rank_00001.pt")
    export_fails(tmp_path / "nowhere", "no complete checkpoint")

    # An --out that is the source or holds it (--overwrite would delete what is read), or a file.
    run_copy = tmp_path / "run_copy"
    shutil.copytree(runs["tp2_zero2"], run_copy)
    for out in (run_copy, tmp_path):
        assert export_main(["--checkpoint", str(run_copy), "--out", str(out), "--overwrite"]) == 2
        assert f"--out {out} holds the checkpoint" in capsys.readouterr().err
    hf_model = imported[1].parent / "src"
    assert import_main(["--model", str(hf_model), "--out", str(hf_model), "--overwrite"]) == 2
    assert "holds the Hugging Face model" in capsys.readouterr().err
    assert import_main(["--model", str(hf_model), "--out", str(tmp_path / "new"), "--tokenizer", str(tmp_path / "nope")]) == 2
    assert (f"--tokenizer {tmp_path / 'nope'}: no tokenizer.model there; give the directory data_prep.import_tokenizer "
            "made from the model's own tokenizer.model") in capsys.readouterr().err
    assert (run_copy / "checkpoints").is_dir() and (hf_model / "config.json").is_file()
    (tmp_path / "a_file").write_text("")
    assert export_main(["--checkpoint", str(run_copy), "--out", str(tmp_path / "a_file")]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    new = ["--out", str(tmp_path / "new")]
    assert export_main(["--checkpoint", str(run_copy), *new, "--max-shard-size", "5XB"]) == 2
    assert "--max-shard-size 5XB" in capsys.readouterr().err and not (tmp_path / "new").exists()
    assert consolidate_main(["--checkpoint", str(run_copy), "--out", str(tmp_path), "--overwrite"]) == 2
    assert "is a directory; give the file to write" in capsys.readouterr().err
    tag = run_copy / "checkpoints" / "step_00000002"
    inside = tag / "mp_rank_00_model_states.pt"  # a file of the checkpoint being read
    assert consolidate_main(["--checkpoint", str(tag), "--out", str(inside), "--overwrite"]) == 2
    assert "lies in the checkpoint" in capsys.readouterr().err
    assert convert_experts_main([str(tag), str(inside), "--overwrite"]) == 2
    assert "lies in the checkpoint" in capsys.readouterr().err
    assert (tag / "COMPLETE").is_file() and inside.stat().st_size > 0


def test_export_formats_and_unsupported_imports(tmp_path, capsys):
    from models.config import ModelConfig

    # relu "seqlen" rescales earlier rows as the sequence grows: the exported model does not cache
    from tools.export import ExportError, _remote_module, export_format
    from tools.import_hf import main as import_main

    remote = _remote_module()
    config = remote.UoEPretrainConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=48, attention_kinds=["softmax", "relu"],
                                      relu_normalizer="seqlen")
    torch.manual_seed(0)
    model = remote.UoEPretrainForCausalLM(config).eval()
    assert not model.model.cacheable
    prompt = torch.tensor([[3, 4, 5]])
    assert torch.equal(model.generate(prompt, do_sample=False, max_new_tokens=5, use_cache=True),
                       model.generate(prompt, do_sample=False, max_new_tokens=5, use_cache=False))
    assert export_format(ModelConfig(num_layers=2)) == "llama"
    assert export_format(ModelConfig(mlp="uoe", num_layers=2)) == "remote"
    assert export_format(ModelConfig(attention="sr", num_layers=2)) == "remote"
    with pytest.raises(ExportError, match="not divisible by num_heads"):
        export_format(ModelConfig(hidden_size=66, num_heads=4, num_layers=2))

    for hf_config, needle in (
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 3, "num_hidden_layers": 1, "intermediate_size": 96,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
         "unsupported Llama settings: num_key_value_heads=3 does not divide num_attention_heads=4; rope_scaling"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 96,  # newer transformers
          "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}},
         "unsupported Llama settings: rope_parameters={'rope_type': 'llama3'"),
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 96, "sliding_window": 4096,
          "max_position_embeddings": 32768},  # Mistral 7B v0.1: a window, not every earlier position
         "sliding_window=4096 below max_position_embeddings=32768"),
    ):
        model_dir = tmp_path / f"hf_{time.monotonic_ns()}"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(hf_config))
        out = tmp_path / "import_out"
        assert import_main(["--model", str(model_dir), "--out", str(out)]) == 2
        assert needle in capsys.readouterr().err
        assert not out.exists()
    # Llama architectures in other words: plain RoPE named as a scaling type, Mistral without a window
    from tools.import_hf import check_supported

    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "hidden_size": 64}
    check_supported({**llama, "rope_scaling": {"rope_type": "default"}})
    check_supported({**llama, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None})


@pytest.fixture(scope="module")
def remote_runs(data, tmp_path_factory):
    """Models exported with the bundled modeling file, one after the other:
    * uoe_ep2: Union-of-Experts (carved sizing: 8 of each expert's 32 neurons route) at EP=2 x DP=2,
      ZeRO-1 (experts in per-rank DeepSpeed files);
    * hybrid_moe_tp2: softmax / softmax_sink / lisa / relu (content normaliser) / lisa attention with
      grouped-query attention (2 K/V heads, one per TP rank) and a top-k router MoE (shared expert,
      on layers 1 and 3) at TP=2, ZeRO-2; the experts split over TP."""
    root, vocab = data
    base = tmp_path_factory.mktemp("remote_runs")
    common = {"model.vocab_size": vocab, "train.steps": STEPS, "train.warmup_steps": 1, "train.eval_interval": STEPS,
              "train.save_interval": STEPS, "train.eval_batches": 1, "model.moe.num_experts": 4,
              "model.moe.expert_hidden_size": 32, "model.moe.shared_hidden_size": 32}
    layouts = {
        "uoe_ep2": {"model.mlp": "uoe", "model.moe.top_k": 2, "model.moe.bias_update_rate": 0.001,
                    "model.moe.sizing": "carved",
                    "parallel.expert": 2, "parallel.zero_stage": 1},
        "hybrid_moe_tp2": {"model.mlp": "moe", "model.moe.top_k": 1, "model.moe.moe_layers": "1,3",
                           "model.num_layers": 5, "model.attention": "sklrl", "model.lisa.keep_full_layers": 2,
                           "model.num_kv_heads": 2, "model.relu_attention.normalizer": "content",
                           "model.lisa.align_group": 2,
                           "model.tie_embeddings": True, "parallel.tensor": 2, "parallel.zero_stage": 2},
    }
    for name, extra in layouts.items():
        train_run(root, base / name, {**common, **extra})
    return {name: base / name for name in layouts}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["uoe_ep2", "hybrid_moe_tp2"])
def test_remote_code_export_logits_match_framework(remote_runs, data, dist_env, tmp_path, capsys, layout):
    """UoE / MoE / hybrid-attention checkpoints export with the modeling file; transformers loads
    them with trust_remote_code and gives the framework's logits; the trainer's validation loss is
    reproduced by evaluate from the same checkpoint."""
    from transformers import AutoModelForCausalLM

    from tools.evaluate import main as evaluate_main
    from tools.export import main as export_main

    root, vocab = data
    run = remote_runs[layout]
    if layout == "uoe_ep2":
        assert list((run / "checkpoints" / "step_00000002").glob("layer_*_expert_3_mp_rank_00_model_states.pt"))
    else:
        assert list((run / "checkpoints" / "step_00000002").glob("layer_*_expert_*_mp_rank_01_model_states.pt"))
    assert evaluate_main(["--checkpoint", str(run), "--shards", str(root / "shards"), "--batches",
                          "2" if layout == "uoe_ep2" else "1", "--batch-size", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["loss"] == pytest.approx(val_loss_logged(run, STEPS), abs=1e-4)

    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(run), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["UoEPretrainForCausalLM"] and config["vocab_size"] == vocab
    assert config["num_key_value_heads"] == (2 if layout == "hybrid_moe_tp2" else 4)
    assert config["expert_hidden_size"] == (24 if layout == "uoe_ep2" else 32)  # carved: 32 - 8 routing
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_uoe_pretrain.UoEPretrainForCausalLM"
    assert (out / "modeling_uoe_pretrain.py").is_file() and (out / "tokenizer.model").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    tokens = fixed_tokens(vocab)
    with torch.no_grad():
        theirs = model(tokens).logits
    ours = framework_logits(run, tokens)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert ours.std() > 0.05
    with torch.no_grad():  # KV cache (every attention kind incl. LISA): prefix, then the rest in two pieces
        head = model(tokens[:, :20], use_cache=True)
        # a cache passed in is read whatever use_cache says (as transformers' Llama does)
        mid = model(tokens[:, 20:21], past_key_values=head.past_key_values, use_cache=False)
        tail = model(tokens[:, 21:], past_key_values=mid.past_key_values, use_cache=True)
        with pytest.raises(TypeError, match="past_key_values is a tuple.*DynamicCache"):
            model(tokens[:, 21:], past_key_values=((tokens, tokens),))
    assert tail.past_key_values.get_seq_length() == tokens.shape[1]
    assert (torch.cat([head.logits, mid.logits, tail.logits], 1) - theirs).abs().max().item() <= 1e-4
    # Padded prompts are refused by generate() (new tokens would follow the padding), with the fix.
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="padded prompts.*one prompt at a time"):
        model.generate(tokens[:, :5], attention_mask=mask, do_sample=False, max_new_tokens=2)
    if layout == "uoe_ep2":  # the router bias (aux-loss-free balancing) moved and travels with the weights
        from pretrain.consolidate import load_model

        framework, _, _ = load_model(run)
        assert framework.blocks[0].mlp.router_bias.abs().sum() > 0
        assert torch.equal(model.model.blocks[0].mlp.router_bias, framework.blocks[0].mlp.router_bias)
        # In bf16 the weights are rounded, the selection bias is not (training kept it in fp32).
        from safetensors.torch import load_file

        assert export_main(["--checkpoint", str(run), "--out", str(tmp_path / "hf16"), "--dtype", "bf16"]) == 0
        saved = {k: v for f in (tmp_path / "hf16").glob("*.safetensors") for k, v in load_file(f).items()}
        biases = {k: v for k, v in saved.items() if k.endswith("router_bias")}
        assert biases and all(v.dtype == torch.float32 for v in biases.values())
        assert torch.equal(biases["model.blocks.0.mlp.router_bias"], framework.blocks[0].mlp.router_bias)
        assert {v.dtype for k, v in saved.items() if k not in biases} == {torch.bfloat16}


ISOLATED_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
assert not any(m.split(".")[0] in ("models", "pretrain") for m in sys.modules), "framework imported"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
tokens = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    logits = model(tokens).logits
new = model.generate(tokens[:1, :5], do_sample=False, max_new_tokens=6)[0, 5:].tolist()
assert not any(m.split(".")[0] in ("models", "pretrain") for m in sys.modules), "framework imported"
torch.save({"logits": logits, "generated": new}, sys.argv[3])
"""


@pytest.mark.slow
def test_remote_code_runs_without_the_framework(remote_runs, data, dist_env, tmp_path):
    """The exported folder works in a process that cannot import the framework (another working
    directory, no PYTHONPATH): same logits, and HF greedy generation equals tools.generate's."""
    from models.generation import generate
    from pretrain.consolidate import load_model
    from tools.export import main as export_main

    _, vocab = data
    run, out = remote_runs["uoe_ep2"], tmp_path / "hf"
    assert export_main(["--checkpoint", str(run), "--out", str(out)]) == 0
    tokens = fixed_tokens(vocab)
    env = child_env()
    env.pop("PYTHONPATH", None)
    isolated = tmp_path / "elsewhere"
    isolated.mkdir()
    proc = subprocess.run([sys.executable, "-c", ISOLATED_LOAD, str(out), json.dumps(tokens.tolist()),
                           str(tmp_path / "result.pt")], cwd=isolated, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt")
    assert (result["logits"] - framework_logits(run, tokens)).abs().max().item() <= 1e-4
    model, _, _ = load_model(run)
    assert result["generated"] == generate(model, tokens[0, :5].tolist(), 6, greedy=True)


LM_EVAL_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.mark.slow
def test_lm_eval_scores_an_export_like_the_framework(remote_runs, data, dist_env, tmp_path):
    """lm-evaluation-harness (its hf backend, trust_remote_code, no network) on an exported hybrid
    attention + MoE model with a local multiple-choice task: every choice's log-likelihood and the
    accuracies equal pretrain.downstream's on the checkpoint."""
    from data_prep.tokenizer import load_tokenizer
    from pretrain.consolidate import load_model
    from pretrain.downstream import accuracy, choice_logprobs, load_task, requests
    from tools.export import main as export_main

    root, _ = data
    run, out = remote_runs["hybrid_moe_tp2"], tmp_path / "hf"
    assert export_main(["--checkpoint", str(run), "--out", str(out)]) == 0
    words = corpus_text().split()
    # Short for the model's 32 positions; the longer contexts are cut from the left (by both).
    records = [{"context": " ".join(words[i:i + 3]), "gold": i % 3,
                "choices": [" ".join(words[i + 3 + 2 * c:i + 4 + 2 * c + c % 2]) for c in range(3)]}
               for i in range(0, 80, 10)]
    task_file = tmp_path / "tasks" / "tiny_mc.jsonl"
    task_file.parent.mkdir()
    task_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(LM_EVAL_TASK.format(data=task_file))
    env = child_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={out},trust_remote_code=True,dtype=float32,add_bos_token=False", "--tasks", "tiny_mc",
         "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "4", "--log_samples",
         "--output_path", str(tmp_path / "results")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())["results"]["tiny_mc"]
    samples = [json.loads(line) for line in next((tmp_path / "results").rglob("samples_tiny_mc_*.jsonl")).open()]
    theirs = torch.tensor([float(resp[0]) for s in sorted(samples, key=lambda s: s["doc_id"])
                           for resp in s["filtered_resps"]], dtype=torch.float64)

    examples = load_task(task_file)
    model, cfg, _ = load_model(run)
    sp, _ = load_tokenizer(root / "tokenizer")
    ours = choice_logprobs(model.eval(), requests(examples, sp, cfg.max_seq_len), 4, torch.device("cpu"))
    assert len(theirs) == len(ours) == 3 * len(records) and ours.std() > 0.1
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    mine = accuracy(examples, ours)
    assert (results["acc,none"], results["acc_norm,none"]) == (mine["acc"], mine["acc_norm"])


def evaluate_loss(checkpoint, shards, batches: int, capsys) -> float:
    from tools.evaluate import main as evaluate_main

    assert evaluate_main(["--checkpoint", str(checkpoint), "--shards", str(shards), "--batches", str(batches),
                          "--batch-size", "4", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["imported_gqa", "uoe_ep2"])
def test_init_from_loads_weights_at_another_layout(source, imported, remote_runs, data, dist_env, tmp_path, capsys):
    """train.init_from re-splits a checkpoint for another layout: the imported (GQA) Llama at TP=2
    with ZeRO-3, and the UoE run saved at EP=2 x DP=2 at TP=2 x EP=1 with ZeRO-2 (experts by global
    id, then split over TP). With lr = 0 the weights stay as loaded, so the validation loss after
    step 1 must equal the source checkpoint's loss on the same samples."""
    root, vocab = data
    if source == "imported_gqa":
        src = imported[1] / "checkpoints" / "step_00000000"
        model = {"model.ffn_hidden_size": LLAMA["intermediate_size"], "model.norm_eps": LLAMA["rms_norm_eps"],
                 "model.num_kv_heads": LLAMA["num_key_value_heads"],
                 "model.rope_base": LLAMA["rope_theta"], "parallel.zero_stage": 3}
    else:
        src = remote_runs["uoe_ep2"]
        model = {"model.mlp": "uoe", "model.moe.num_experts": 4, "model.moe.top_k": 2,
                 "model.moe.expert_hidden_size": 32, "model.moe.shared_hidden_size": 32,
                 "model.moe.sizing": "carved", "model.moe.bias_update_rate": 0.0, "parallel.zero_stage": 2}
    run = tmp_path / "continued"
    log = train_run(root, run, {"model.vocab_size": vocab, **model, "parallel.tensor": 2, "train.steps": 1,
                          "train.lr": 0.0, "train.warmup_steps": 0, "train.eval_interval": 1, "train.eval_batches": 1,
                          "train.save_interval": 1, "train.init_from": src})
    assert "started from the weights of" in log
    want = evaluate_loss(src, root / "shards", 1, capsys)
    assert val_loss_logged(run, 1) == pytest.approx(want, abs=1e-4)
    assert 0 < want < 7
    # The new run's own checkpoint now holds the re-split weights: same loss again.
    assert evaluate_loss(run, root / "shards", 1, capsys) == pytest.approx(want, abs=1e-4)


def test_init_from_refuses_another_model(imported, data, tmp_path):
    """A source of another model is refused before any process group or model exists."""
    from pretrain.checkpoint import CheckpointError
    from pretrain.config import load_config
    from pretrain.train import prepare

    root, vocab = data
    src = imported[1] / "checkpoints" / "step_00000000"
    overrides = [f"data.shards={root / 'shards'}", f"data.tokenizer={root / 'tokenizer'}", f"run.dir={tmp_path}",
                 f"model.vocab_size={vocab}", "model.max_seq_len=32", f"train.init_from={src}"]
    cfg = load_config(imported[1] / "config.yaml", overrides)
    assert prepare(cfg, 1)[2] == src
    cfg = load_config(imported[1] / "config.yaml", [*overrides, "model.ffn_hidden_size=128"])
    with pytest.raises(CheckpointError, match="ffn_hidden_size.*; point train.init_from at a checkpoint"):
        prepare(cfg, 1)
    cfg = load_config(imported[1] / "config.yaml", [*overrides[:-1], f"train.init_from={tmp_path / 'nothing'}"])
    with pytest.raises(CheckpointError, match="train.init_from"):
        prepare(cfg, 1)
    # Its own checkpoint, which train.resume=none would set aside before loading it.
    cfg = load_config(imported[1] / "config.yaml", [*overrides, f"run.dir={imported[1]}", "train.resume=none"])
    with pytest.raises(CheckpointError, match="a checkpoint of run.dir itself"):
        prepare(cfg, 1)


def test_evaluate_names_the_splits_the_shards_have(tmp_path):
    """Shards built with --val-fraction 0 have no val split: the error says which splits there are."""
    from tools.cli import ToolError
    from tools.evaluate import split_dir

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "index.json").write_text("{}")
    with pytest.raises(ToolError, match="has no val split, only train: choose one with --split"):
        split_dir(tmp_path, "val", "--split")
    assert split_dir(tmp_path, "train") == tmp_path / "train"
    with pytest.raises(ToolError, match="neither"):
        split_dir(tmp_path / "train" / "nothing", "val")


def test_remote_code_routing_and_head_alignment_follow_their_formulas():
    """The bundled modeling file on its own: experts picked on scores + bias, weighted by the softmax
    of the unbiased scores; LISA's head alignment over several blocks of query rows equals
    M S + W2 GELU(W1 S + b1) + b2 per group, unblocked."""
    import torch.nn.functional as F

    from models.hf import modeling_uoe_pretrain as remote

    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 4, generator=gen).log_softmax(-1)
    bias = torch.tensor([3.0, -3.0, 0.0, 0.0])  # expert 0 always picked, expert 1 never
    selected, weights = remote.top_k(scores, bias, 2)
    assert torch.equal(selected, (scores + bias).topk(2, dim=-1).indices) and (selected[:, 0] == 0).all()
    torch.testing.assert_close(weights, torch.softmax(scores.gather(-1, selected), -1))
    assert not torch.allclose(weights, torch.softmax((scores + bias).gather(-1, selected), -1))

    align = remote.HeadAlign(heads=4, group=2, hidden=3)
    with torch.no_grad():
        for p in align.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    s = torch.randn(1, 4, 20, 20, generator=gen)
    g = s.view(1, 2, 2, 20, 20)  # [batch, group, head in group, q, k]
    hidden = F.gelu(torch.einsum("ghj,bgjqk->bghqk", align.w1, g) + align.b1[None, :, :, None, None])
    want = (torch.einsum("gij,bgjqk->bgiqk", align.mix, g) + torch.einsum("gih,bghqk->bgiqk", align.w2, hidden)
            + align.b2[None, :, :, None, None])
    align.ROW_BLOCK = 8  # three blocks of query rows
    with torch.no_grad():
        torch.testing.assert_close(align(s), want.reshape(1, 4, 20, 20).detach(), rtol=1e-5, atol=1e-5)


def test_rope_angles_are_transformers_llama_s_at_every_position():
    """Imported Llamas were trained, and exported ones run, with transformers' float32 angles:
    float64 ones drift from them with the position (1.5e-3 in the logits at 4k positions)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from models.hf.modeling_uoe_pretrain import rope_tables
    from models.layers import Rotary

    seq, head_dim, base = 8192, 64, 500000.0
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=base, max_position_embeddings=seq)
    x = torch.zeros(1, seq, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(seq)[None])
    ours = Rotary(head_dim, seq, base)
    assert torch.equal(ours.cos, cos[0, :, : head_dim // 2]) and torch.equal(ours.sin, sin[0, :, : head_dim // 2])
    bundled = rope_tables(head_dim, 4096, seq, base, "cpu")  # the exported modeling file, from a cache offset
    assert torch.equal(bundled[0], ours.cos[4096:]) and torch.equal(bundled[1], ours.sin[4096:])
