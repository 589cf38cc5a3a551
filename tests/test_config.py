"""Config loading, dotted overrides and validation errors that name the key and the fix."""

import json

import pytest

from pretrain.config import ConfigError, load_config, validate, validate_data
from tests.dist_utils import REPO
from tests.synthetic import FAKE_TOKENIZER_SHA, write_synthetic_shards


def test_yaml_numbers_and_empty_values(tmp_path):
    """YAML reads 1e5 as text and an empty value as null: a whole number and the key's default."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 1e5\n  init_from:\n  lr: 1.0e-4\n  resume: None\neval:\nprofile:\n"
                    "  # start_step: 3\n")
    cfg = load_config(path)
    assert cfg.train.steps == 100000 and cfg.train.init_from == "" and cfg.train.lr == 1e-4
    assert cfg.train.resume == "none"
    (tmp_path / "null.yaml").write_text("model:\n  attention:\n  plugins:\ntrain:\n  resume:\n")
    with pytest.raises(ConfigError, match="train.resume is empty: give auto"):  # resume or start afresh?
        load_config(tmp_path / "null.yaml")
    (tmp_path / "null.yaml").write_text("model:\n  attention:\n  plugins:\n")
    empty = load_config(tmp_path / "null.yaml")
    assert empty.model.attention_kinds() == ["softmax", "softmax"] and empty.model.plugins == []
    assert cfg.eval.downstream_tasks == [] and cfg.profile.start_step == 0


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 3\ntrain:\n  lr: 0.01\n")
    cfg = load_config(path, ["train.lr=3e-4", "model.tie_embeddings=true", "model.attention=[softmax, relu, lisa]"])
    assert cfg.model.num_layers == 3 and cfg.train.lr == 3e-4 and cfg.model.tie_embeddings is True
    assert cfg.model.attention_kinds() == ["softmax", "relu", "lisa"]
    assert load_config(None, ["run.dir=[exp]v1"]).run.dir == "[exp]v1"  # a path, not a YAML list
    # auto / true / false keys also take the spellings their boolean forms took
    switches = load_config(path, ["train.compile=On", "train.fused_optimizer=0",
                                  "model.moe.grouped_gemm=AUTO"])
    assert (switches.train.compile, switches.train.fused_optimizer, switches.model.moe.grouped_gemm) == \
        ("true", "false", "auto")


@pytest.mark.parametrize("override, message", [
    (["model.nonexistent=1"], "unknown config key 'model.nonexistent'"),
    (["model.toy.temperature=0.5"], "a section a plug-in registers: list its module in model.plugins"),
    (["train.lr=fast"], "train.lr='fast': expected float"),
    (["model.tie_embeddings=maybe"], "expected true or false"),
    (["train"], "must look like section.key=value"),
    (["model.attention=[softmax,", "relu]"], r"override 'relu\]' must look like section.key=value; the shell split the "
                                             r"value of model.attention at its spaces: quote the whole override, as "
                                             r"'model.attention=\[a, b\]'"),
    (["data.mix=[{shards: a/shards}, {shards: b/shards}]"], r"data.mix names \['shards', 'shards'\] repeat \(a "
                                                            r"source's name defaults to its folder's name\); give each "
                                                            r"entry a distinct name: data.mix='\[\{shards: A, name: web\}"),
    (["train.warmup_steps=0.05"], "train.warmup_steps='0.05': expected a whole number"),  # not truncated to 0
    (["train.eval_interval=true"], "expected a whole number"),
    (["train.lr=true"], "expected float"),
    (["model.attention=[softmax, relu"], r"model.attention='\[softmax, relu': not a list .* write it as \[a, b, c\]"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


@pytest.mark.parametrize("override, world, message", [
    (["model.num_heads=4", "parallel.tensor=3"], 3, "num_heads=4 is not divisible by parallel.tensor=3"),
    (["model.hidden_size=100", "model.num_heads=3"], 1, "hidden_size=100 is not divisible by model.num_heads=3"),
    (["parallel.tensor=2"], 3, "world size 3 is not divisible by parallel.tensor=2"),
    (["parallel.expert=2"], 2, "needs an expert model"),
    (["model.mlp=uoe", "model.moe.num_experts=3", "parallel.expert=2"], 2, "num_experts=3 is not divisible"),
    (["model.mlp=moe", "parallel.zero_stage=3"], 1, "does not support expert layers"),
    (["model.mlp=moe", "parallel.expert=2", "parallel.zero_stage=0"], 2, "clips by a wrong norm"),
    (["model.attention=sx"], 1, r"unknown letters \['x'\]; .* list it in model.plugins"),
    (["model.attention=softmax-sink"], 1, r"'softmax-sink' is no attention kind; did you mean 'softmax_sink'\?"),
    (["model.attention=s,k", "model.num_layers=2"], 1,
     r"letters go without commas \('sk'\); kinds are listed with them \('softmax,softmax_sink'\)"),
    (["model.attention=ssll", "model.num_layers=4", "model.lisa.keep_full_layers=3"], 1,
     r"lisa at layers \[2\], .* move them to layer 3 or later, or lower keep_full_layers"),
    (["model.attention=ssll", "model.num_layers=4", "model.lisa.keep_full_layers=8"], 1,
     r"lisa at layers \[2, 3\], .* lower keep_full_layers below 4, the model's number of layers"),
    (["model.attention=ssll", "model.num_layers=4", "model.lisa.align_hidden=-1"], 1,
     r"model.lisa.align_hidden=-1 must be >= 0 \(0: linear head mixing\)"),
    (["model.attention=ssll", "model.num_layers=4", "model.num_heads=4", "parallel.tensor=2"], 2,
     r"set model.lisa.align_group to a divisor of 2 \(0 means all heads\)"),
    (["model.attention=softmax,relu", "model.num_layers=3"], 1, "lists 2 layers"),
    (["train.warmup_steps=500", "train.steps=100"], 1, "warmup_steps=500 must be smaller"),
    (["train.warmup_steps=-1"], 1, "warmup_steps=-1 must be >= 0"),
    (["train.activation_checkpointing=some"], 1, "choose one of"),
    (["train.compile=sometimes"], 1, "train.compile='sometimes': choose auto, true or false"),
    (["model.mlp=moe", "model.moe.grouped_gemm=maybe"], 1,
     "grouped_gemm='maybe': choose auto, true or false"),
    (["model.mlp=moe", "model.moe.grouped_gemm=true", "model.moe.expert_hidden_size=36"], 1,
     "expert width per tensor-parallel rank=36 must be a multiple of 8"),
    (["model.mlp=uoe", "model.moe.sizing=carved", "model.moe.routing_neurons=128"], 1,
     "sizing=carved takes N_s=128 routing neurons out of expert_hidden_size=128, which leaves none"),
    (["model.mlp=uoe", "model.moe.sizing=inside", "model.moe.routing_neurons=8"], 1,
     "choose additive or carved"),
    (["model.mlp=uoe", "model.moe.num_experts=0"], 1, "num_experts=0 must be >= 1"),
    (["model.mlp=moe", "model.moe.sizing=carved"], 1, "a router MoE has none"),
    (["model.mlp=uoe", "model.moe.num_experts=4", "model.moe.shared_hidden_size=10"], 1,
     "shared_hidden_size=10 is not a multiple of num_experts=4"),
    (["model.mlp=uoe", "model.moe.shared_hidden_size=16", "model.moe.router_z_loss_coef=0.001"], 1,
     "UoE has no router"),
    (["train.fused_optimizer=maybe"], 1, "fused_optimizer='maybe': choose auto, true or false"),
    (["data.mix=data/web"], 1, "give a list of sources"),
    (["data.mix=[{shards: a, weight: 0}]"], 1, r"data.mix\[0\].weight=0.0: must be a number > 0"),
    (["data.mix=[{shards: a, share: 2}]"], 1, r"data.mix\[0\]: unknown key share; an entry takes shards, weight"),
    (["data.mix=[{weight: 2}]"], 1, r"data.mix\[0\]=.*give a mapping with shards"),
    (["data.mix=[{shards: a, weight: true}]"], 1, r"data.mix\[0\].weight=True: expected a number"),
    (["data.mix=[{shards: x/web}, {shards: y/web}]"], 1, r"names \['web', 'web'\] repeat"),
    (["data.mix=[{shards: a, name: 'web mix'}]"], 1, "must be letters, digits"),
    (["train.beta1=1.5"], 1, "train.beta1=1.5 and train.beta2=0.95 must be in"),
    (["train.lr=-1"], 1, "train.lr=-1.0 must be >= 0"),
    (["train.grad_clip=-1"], 1, r"train.grad_clip=-1.0 must be >= 0 \(0 = no clipping\)"),
    (["train.eval_batches=-3"], 1, "train.eval_batches=-3 must be >= 0"),
    (["data.num_canonical_nodes=0"], 1, "data.num_canonical_nodes=0 >= 1"),
    (["model.num_heads=0"], 1, "model.num_heads=0 must be >= 1"),
    (["model.attention=ssl", "model.num_layers=3", "model.lisa.align_group=-2"], 1,
     "model.lisa.align_group=-2 must be >= 0"),
    (["model.attention=ssl", "model.num_layers=3", "model.lisa.align_hidden=-4"], 1,
     "model.lisa.align_hidden=-4 must be >= 0"),
    (["model.vocab_pad_to=0"], 1, "model.vocab_pad_to=0 must be >= 1"),
    (["model.vocab_size=4096", "model.vocab_pad_to=3", "parallel.tensor=4"], 4,
     r"the padded vocabulary \(4098, model.vocab_pad_to=3\) must divide by parallel.tensor=4"),
    (["profile.start_step=300", "train.steps=200"], 1, "after the last step"),
    (["profile.start_step=5", "profile.steps=0"], 1, "must be >= 1"),
    (["profile.start_step=5", "profile.ranks=0,8"], 8, "names rank 8, but the world has 8 ranks"),
    (["profile.start_step=5", "profile.ranks=first"], 1, r"profile.ranks='first': give 'all' or indices >= 0"),
    (["profile.start_step=5", "profile.ranks=[1, -1]"], 2, "indices >= 0"),
    (["profile.start_step=5", "profile.ranks=[0, 2]"], 2, "names rank 2, but the world has 2 ranks"),
    (["train.stop_at_step=500", "train.steps=300"], 1, "stop_at_step=500 is past train.steps=300"),
    (["run.callbacks=[tests.user_callbacks]"], 1, "give package.module:name"),
    (["eval.val_sets=[{shards: data/c4, weight: 2}]"], 1, r"eval.val_sets\[0\]: a validation set has no weight"),
    (["data.mix=[{shards: data/web}, {shards: data/code}]", "eval.val_sets=[{shards: data/c4, name: code}]"], 1,
     r"eval.val_sets names \['code'\] as data.mix does"),
    (["run.callbacks=[tests.no_such_module:X]"], 1, "cannot import tests.no_such_module"),
    (["run.callbacks=[tests.user_callbacks:Missing]"], 1, "tests.user_callbacks has no Missing"),
    (["train.save_interval=100", "train.keep_every=250"], 1, "keep_every=250 must be 0 .* or a multiple of "
                                                             r"train.save_interval=100"),
    (["train.save_interval_minutes=-30"], 1, r"save_interval_minutes=-30.0 must be >= 0 \(0 = by steps only\)"),
    (["train.batch_ramp_start=4", "train.grad_accum=4"], 1, "batch_ramp_steps=0 must be in \\[1, train.steps"),
    (["train.batch_ramp_start=16", "train.batch_ramp_steps=5", "train.grad_accum=2"], 2,
     r"batch_ramp_start=16 must be below the global batch it ramps to \(4 x train.grad_accum=2 x 2 = 16\)"),
    (["train.batch_ramp_steps=5"], 1, "ramps from train.batch_ramp_start, which is 0"),
    (["train.batch_ramp_start=2", "train.batch_ramp_steps=5"], 1, "up to train.grad_accum, which is 1"),
    (["eval.sample_tokens=0", "eval.sample_prompts=[def]"], 1, r"eval.sample_tokens=0 >= 1"),
    (["data.synthetic=true", "eval.sample_prompts=[def]"], 1, "eval.sample_prompts needs the run's tokenizer"),
    (["train.stop_after_minutes=-1"], 1, r"stop_after_minutes=-1.0 must be >= 0 \(0 = no time limit\)"),
    (["train.stop_after_minutes=1e9"], 1, r"stop_after_minutes=1e\+09 is more than a timer holds"),
])
def test_validation_errors(override, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, override), world)


def test_data_mismatch_errors(tmp_path):
    root = write_synthetic_shards(tmp_path, seq_len=32, vocab_size=256, train=8, val=2)
    base = [f"data.shards={root}/shards", f"data.tokenizer={root}/tokenizer"]
    cfg = load_config(None, base + ["model.max_seq_len=64", "model.vocab_size=256"])
    with pytest.raises(ConfigError, match="set model.max_seq_len=32"):
        validate_data(cfg)
    cfg = load_config(None, base + ["model.max_seq_len=32", "model.vocab_size=512"])
    with pytest.raises(ConfigError, match="set model.vocab_size=256"):
        validate_data(cfg)
    cfg = load_config(None, [f"data.shards={root}/shards", f"data.tokenizer={tmp_path}/no_tokenizer",
                             "model.max_seq_len=32", "model.vocab_size=256"])
    with pytest.raises(ConfigError, match="no tokenizer.json there; train one with"):
        validate_data(cfg)
    cfg = load_config(None, [f"data.shards={root}/shards", "data.tokenizer=", "model.max_seq_len=32",
                             "model.vocab_size=256"])
    with pytest.raises(ConfigError, match="data.tokenizer is empty .*set data.tokenizer to the tokenizer directory"):
        validate_data(cfg)
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "gold": 0}) + "\n")
    cfg = load_config(None, ["data.shards=s3://bucket/shards", "data.tokenizer=", f"eval.downstream_tasks=[{task}]",
                             "eval.downstream_interval=10"])
    with pytest.raises(ConfigError, match="data.tokenizer is empty .* the downstream tasks are encoded with"):
        validate_data(cfg)  # remote shards are not read here: the tasks still need it
    meta = root / "tokenizer" / "tokenizer.json"
    meta.write_text(json.dumps({"vocab_size": 256, "sha256": "f" * 64}))
    cfg = load_config(None, base + ["model.max_seq_len=32", "model.vocab_size=256"])
    with pytest.raises(ConfigError, match="different tokenizer"):
        validate_data(cfg)
    cfg = load_config(None, [f"data.shards={tmp_path}/nowhere"])
    with pytest.raises(ConfigError, match="build shards with"):
        validate_data(cfg)
    # 8 train samples: two data-parallel ranks get 4 each, one micro-batch of 4; four ranks get 2
    meta.write_text(json.dumps({"vocab_size": 256, "sha256": FAKE_TOKENIZER_SHA}))
    cfg = load_config(None, base + ["model.max_seq_len=32", "model.vocab_size=256", "train.micro_batch=4"])
    assert validate_data(cfg, world_size=2)["seq_len"] == 32
    too_few = "holds 8 samples, fewer than train.micro_batch=4 for each of the 4 "
    with pytest.raises(ConfigError, match=too_few):
        validate_data(cfg, world_size=4)


def test_mixture_sources_are_checked_one_by_one(tmp_path):
    good = write_synthetic_shards(tmp_path / "good", seq_len=32, vocab_size=256, train=8, val=2)
    longer = write_synthetic_shards(tmp_path / "longer", seq_len=64, vocab_size=256, train=8, val=2)
    base = [f"data.tokenizer={good}/tokenizer", "model.max_seq_len=32", "model.vocab_size=256"]
    mix = f"data.mix=[{{shards: {good}/shards, weight: 2}}, {{shards: {longer}/shards, name: long}}]"
    with pytest.raises(ConfigError, match=r"data.mix entry 'long' .* hold sequences of 64"):
        validate_data(load_config(None, base + [mix]))
    mix = f"data.mix=[{{shards: {good}/shards}}, {{shards: {tmp_path}/missing}}]"
    with pytest.raises(ConfigError, match=r"data.mix entry 'missing' .*no manifest.json there"):
        validate_data(load_config(None, base + [mix]))
    manifest = validate_data(load_config(None, base + [f"data.mix=[{{shards: {good}/shards}}]"]))
    assert manifest["seq_len"] == 32
    # eval.val_sets are checked as the training sources are
    held = f"eval.val_sets=[{{shards: {longer}/shards, name: c4}}]"
    with pytest.raises(ConfigError, match=r"eval.val_sets entry 'c4' .* hold sequences of 64"):
        validate_data(load_config(None, base + [f"data.shards={good}/shards", held]))
    # What a directory without manifest.json is, and what to do about it
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "plan.json").write_text("{}")
    for where, fix in ((f"{tmp_path}/unfinished", "an unfinished build .*run its python -m data_prep.build_shards "
                                                  "command again"),
                       (f"{good}/shards/train", f"one split of a build: give the build's directory, {good}/shards")):
        with pytest.raises(ConfigError, match=f"no manifest.json there; it is {fix}"):
            validate_data(load_config(None, base + [f"data.mix=[{{shards: {good}/shards}}, {{shards: {where}}}]"]))
    # A copy or build that lost files: refused before training, not a traceback in the loader
    import shutil

    for lose, error in (("train/index.json", r"train/index.json is missing: the build is incomplete"),
                        ("val/index.json", r"val/index.json is missing"),
                        ("train/shard.00000.mds.zstd", r"1 of the 1 shard files train/index.json lists are missing "
                                                  r"\(first: train/shard.00000.mds.zstd\)")):
        copy = tmp_path / lose.replace("/", "-").replace(".", "_")
        shutil.copytree(f"{good}/shards", copy)
        (copy / lose).unlink()
        with pytest.raises(ConfigError, match=f"data.mix entry '{copy.name}' .*: {error}"):
            validate_data(load_config(None, base + [f"data.mix=[{{shards: {good}/shards}}, {{shards: {copy}}}]"]))


def test_yaml_mistakes_and_text_keys_given_lists_are_config_errors(tmp_path):
    """A section given twice (YAML keeps the last alone), a syntax error, and a list where one path
    goes: errors naming the file, line or key, not silent defaults or tracebacks."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  steps: 7\nmodel:\n  hidden_size: 64\ntrain:\n  lr: 1.0e-4\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: 'train' is given twice \(lines 1 and 5\)"):
        load_config(twice)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: 128\n num_layers: 4\n")
    with pytest.raises(ConfigError, match=r"(?s)bad.yaml: not valid YAML: .*line 3"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"data.shards=\['a', 'b'\]: expected one value, not a list \(several "
                                          r"shard sets: data.mix"):
        load_config(None, ["data.shards=[a, b]"])
    with pytest.raises(ConfigError, match=r"run.dir=\['x'\]: expected one value"):
        load_config(None, ["run.dir=[x]"])


def test_foreign_tokenizer_and_manifest_files_are_config_errors(tmp_path):
    """A Hugging Face tokenizer.json where data.tokenizer points, and a manifest.json that is not a
    shard build's: errors naming the key and the fix, not KeyError tracebacks."""
    root = write_synthetic_shards(tmp_path, seq_len=32, vocab_size=256, train=8, val=2)
    base = ["model.max_seq_len=32", "model.vocab_size=256"]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
    cfg = load_config(None, base + [f"data.shards={root}/shards", f"data.tokenizer={hf}"])
    with pytest.raises(ConfigError, match="data.tokenizer=.*not this framework's tokenizer record"):
        validate_data(cfg)
    for name, text, message in (("truncated", '{"seq_len": 3', "is not JSON"),
                                ("other", '{"files": []}', "is not a manifest data_prep.build_shards wrote "
                                                            r"\(no seq_len, vocab_size, tokenizer_sha256\)")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(text)
        cfg = load_config(None, base + [f"data.shards={tmp_path / name}", f"data.tokenizer={root}/tokenizer"])
        with pytest.raises(ConfigError, match=f"data.shards=.*{name}: .*{message}"):
            validate_data(cfg)


def test_run_dir_empty_or_a_file_is_refused_before_anything_starts(tmp_path):
    from pretrain.train import check_run_dir

    with pytest.raises(ConfigError, match=r"run.dir is empty \(an unset variable\?\)"):
        check_run_dir(" ")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="run.dir=.*afile is a file"):
        check_run_dir(str(tmp_path / "afile"))
    check_run_dir(str(tmp_path / "new" / "run"))  # created when the run starts


def test_sections_no_layer_reads_are_named_when_set():
    """model.moe.* on a dense model, LISA or ReLU settings without such layers: named (the run notes
    them), while a model that reads them, or leaves them at their defaults, has none to name."""
    from models.registry import unread_sections

    def unread(config, *overrides):
        return unread_sections(load_config(REPO / "configs" / config, list(overrides)).model)

    assert unread("tiny_dense.yaml") == [] and unread("tiny_uoe.yaml", "model.moe.num_experts=8") == []
    assert unread("tiny_dense.yaml", "model.moe.num_experts=8") == ["moe"]
    assert unread("tiny_dense.yaml", "model.lisa.rank=4", "model.relu_attention.block_size=64") == \
        ["relu_attention", "lisa"]
    assert unread("tiny_hybrid.yaml", "model.lisa.rank=4") == []


def test_lisa_sizes_compare_as_built():
    """model.lisa.rank 0 (head_dim / 8) and align_group 0 (all heads) are the sizes they resolve to:
    a run saved with one spelling resumes with the other; another size is another model."""
    from pretrain.checkpoint import CheckpointError, check_compatible

    cfg = load_config(REPO / "configs" / "tiny_hybrid.yaml", ["model.lisa.rank=0", "model.lisa.align_group=0"])
    rank, heads = cfg.model.lisa.resolved_rank(cfg.model.head_dim), cfg.model.num_heads
    saved = {"model": cfg.model.to_dict()}
    spelt = load_config(REPO / "configs" / "tiny_hybrid.yaml", [f"model.lisa.rank={rank}",
                                                                f"model.lisa.align_group={heads}"])
    check_compatible(saved, spelt.model.to_dict(), None, "ckpt")
    other = load_config(REPO / "configs" / "tiny_hybrid.yaml", [f"model.lisa.rank={rank + 2}", "model.lisa.align_group=0"])
    with pytest.raises(CheckpointError, match=f"lisa.rank: checkpoint {rank} vs config {rank + 2}"):
        check_compatible(saved, other.model.to_dict(), None, "ckpt")


def test_keys_whose_feature_is_off_are_noted_and_their_values_checked():
    """A key read only under a switch (the WSD shape under schedule=wsd, the spike window under
    skip_spikes, task files under downstream_interval, profile keys under start_step) is named when
    it is set and its switch is off; its value is checked either way."""
    from pretrain.config import inert_settings

    off = load_config(None, ["train.decay_shape=sqrt", "train.decay_fraction=0.3", "train.spike_window=64",
                             "eval.downstream_tasks=[tasks/none.jsonl]", "profile.ranks=all"])
    notes = inert_settings(off)
    assert notes == [
        "note: train.decay_shape='sqrt', train.decay_fraction=0.3 are read with train.schedule=wsd only: they change "
        "nothing here",
        "note: train.spike_window=64 is read with train.skip_spikes=true only: it changes nothing here",
        "note: eval.downstream_tasks=['tasks/none.jsonl'] is read with eval.downstream_interval > 0 only: it changes "
        "nothing here",
        "note: profile.ranks='all' is read with profile.start_step > 0 only: it changes nothing here"]
    on = load_config(None, ["train.schedule=wsd", "train.decay_shape=sqrt", "train.skip_spikes=true",
                            "train.spike_window=64", "profile.start_step=3", "profile.ranks=all"])
    assert inert_settings(on) == [] and inert_settings(load_config(None)) == []
    with pytest.raises(ConfigError, match="train.decay_shape='sqrtt': choose one of"):
        validate(load_config(None, ["train.decay_shape=sqrtt"]), 1)


def test_a_callback_entry_must_give_a_callback():
    import torch

    from pretrain.callbacks import build_callbacks

    cfg = load_config(None, ["run.callbacks=[tests.user_callbacks:not_a_callback]"])
    with pytest.raises(ConfigError, match="gave a object, not a pretrain.trainer.Callback: subclass it"):
        build_callbacks(cfg, torch.nn.Linear(2, 2))
