"""Unsafe-ticket pruning: masked Wanda attribution against a plain computation, the ranking and
selection rules, beam width 1 = greedy, and the tool's pruned checkpoint in the other tools, at
TP=2 and in training."""

import json
import math
import random
import subprocess
import sys

import pytest
import torch

from posttrain.batches import collate_rows, response_row
from posttrain.pruning import Pruner, SearchConfig, State, select, weight_scores
from tests.dist_utils import REPO, child_env, single_process_group, spawn

MODEL = {"model.vocab_size": 400, "model.max_seq_len": 64, "model.hidden_size": 64, "model.num_heads": 4,
         "model.num_layers": 2, "model.ffn_hidden_size": 128}
UOE = {"model.mlp": "uoe", "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden_size": 48,
       "model.moe.shared_hidden_size": 32, "model.moe.routing_neurons": 8}


def build(extra=None, seed=0):
    from models.gpt import GPT
    from pretrain.config import load_config

    torch.manual_seed(seed)
    return GPT(load_config(None, [f"{k}={v}" for k, v in {**MODEL, **(extra or {})}.items()]).model).eval()


def random_rows(rng, count, marker=None):
    rows = []
    for _ in range(count):
        prompt = [rng.randrange(4, 400) for _ in range(rng.randint(3, 8))]
        response = [marker or rng.randrange(4, 400) for _ in range(rng.randint(2, 6))]
        rows.append(response_row(prompt, response + [2]))
    return rows


def test_attribution_is_the_masked_input_rms_of_every_linear():
    from posttrain.attribution import InputNorms

    rng = random.Random(0)
    batch = collate_rows(random_rows(rng, 3), pad_id=3)
    with single_process_group():
        model = build()
        norms = InputNorms(model)
        rms = norms.collect(model, [batch])
        tokens, mask = batch["tokens"][:, :-1], batch["trained"][:, 1:]  # positions predicting the response
        with torch.no_grad():  # the plain chain: embedding, block 0, block 1's attention input
            x = model.embed(tokens)
            first = model.blocks[0].attn_norm(x)
            x = model.blocks[0](x, {"rotary": model.rotary})
            second = model.blocks[1].attn_norm(x)
    for name, inputs in (("blocks.0.attn.qkv.weight", first), ("blocks.1.attn.qkv.weight", second)):
        expected = inputs[mask].pow(2).mean(0).sqrt()
        torch.testing.assert_close(rms[name], expected, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(inputs.reshape(-1, 64).pow(2).mean(0).sqrt(), expected, rtol=1e-3)  # prompts out
    names = set(rms)
    assert {"blocks.0.attn.out.weight", "blocks.1.mlp.w_out.weight"} <= names
    assert not any(n.startswith(("embed", "head")) for n in names)


def test_experts_are_attributed_from_the_rows_routed_to_them():
    from posttrain.attribution import InputNorms

    rng = random.Random(1)
    batch = collate_rows(random_rows(rng, 4), pad_id=3)
    with single_process_group():
        model = build(UOE)
        norms = InputNorms(model)
        seen = {}  # layer 0's expert inputs and choices, as its expert container receives them
        container = model.blocks[0].mlp.experts
        handle = container.register_forward_pre_hook(lambda m, args: seen.update(x=args[0], ids=args[1]))
        rms = norms.collect(model, [batch])
        handle.remove()
        tokens = {t.name: t.tokens for t in norms.targets}
    responses = int(batch["trained"][:, 1:].sum())  # inputs whose next token is trained
    experts = [n for n in rms if ".deepspeed_experts." in n]
    assert len(experts) == 2 * 2 * 4  # 2 layers x 4 experts x (w_in, w_out)
    # Values: the rows routed to each expert, and the SwiGLU of its gate (even rows of w_in) and up
    # (odd rows) that its w_out reads.
    names = {id(p): n for n, p in model.named_parameters()}
    mask = batch["trained"][:, 1:].reshape(-1)
    for g, expert in enumerate(container.deepspeed_moe.experts.deepspeed_experts):
        rows = seen["x"][(seen["ids"] == g).any(-1) & mask]
        hidden = torch.nn.functional.silu(rows @ expert.w_in[0::2].T) * (rows @ expert.w_in[1::2].T)
        torch.testing.assert_close(rms[names[id(expert.w_in)]], rows.pow(2).mean(0).sqrt())
        torch.testing.assert_close(rms[names[id(expert.w_out)]], hidden.pow(2).mean(0).sqrt())
    # top-2 routing: every response token reaches two experts of each layer
    assert sum(tokens[n] for n in experts if n.startswith("blocks.0.") and n.endswith("w_in")) == 2 * responses
    assert tokens["blocks.0.mlp.vse_in.weight"] == responses


def test_scores_and_selection_follow_the_rules():
    weight = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    unsafe, safe = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([2.0, 1.0, 1.0])
    none = torch.zeros_like(weight, dtype=torch.bool)
    ratio = weight_scores(weight, unsafe, safe, "ratio", pool=1.0, pruned=none)
    expected = (weight.abs() * unsafe).double() / (weight.abs() * safe + 1e-8).double()
    torch.testing.assert_close(ratio, expected)
    # One input column's weights share its rms ratio: the larger |W| ranks first, never by rounding.
    column = torch.tensor([[0.3], [0.7], [0.5], [0.9], [0.1]]) * torch.ones(5, 64)
    rms_u, rms_s = torch.rand(64, generator=torch.Generator().manual_seed(0)) + 0.1, torch.full((64,), 0.37)
    ranked = weight_scores(column, rms_u, rms_s, "ratio", 1.0, torch.zeros(5, 64, dtype=torch.bool))
    assert all(ranked[:, j].argsort(descending=True).tolist() == [3, 1, 2, 0, 4] for j in range(64))
    pooled = weight_scores(weight, unsafe, safe, "ratio", pool=0.5, pruned=none)  # top 3 of 6 by |W| x rms_unsafe
    assert torch.isfinite(pooled).sum() == 3 and torch.isfinite(pooled[1, 1]) and torch.isfinite(pooled[0, 1])
    pruned = none.clone()
    pruned[1, 1] = True
    wanda = weight_scores(weight, unsafe, safe, "wanda", 1.0, pruned)
    assert wanda[1, 1] == -float("inf")
    # Wanda's scores rank within each output row: the top of every row ranks alike, whatever the
    # scale of its inputs (a layer after a norm does not take the whole step)
    torch.testing.assert_close(wanda[0], torch.tensor([1 / 3, 1.0, 2 / 3]))  # |W| x rms: 1, 4, 2
    assert wanda[1, 2] == pytest.approx(2 / 3)  # 0, (pruned), 4
    louder = weight_scores(weight * 100, unsafe, safe, "wanda", 1.0, none)
    torch.testing.assert_close(louder, weight_scores(weight, unsafe, safe, "wanda", 1.0, none))
    scores = {"a": torch.tensor([[5.0, 1.0], [4.0, 3.0]]), "b": torch.tensor([[4.5, 0.0]])}
    masks = {"a": torch.zeros(2, 2, dtype=torch.bool), "b": torch.zeros(1, 2, dtype=torch.bool)}
    chosen = select(scores, masks, count=2, skip=0, layer_cap=1.0)
    assert chosen["a"].tolist() == [[True, False], [False, False]] and chosen["b"].tolist() == [[True, False]]
    second = select(scores, masks, count=2, skip=2, layer_cap=1.0)  # the next slice of the ranking
    assert second["a"].tolist() == [[False, False], [True, True]] and not second["b"].any()
    capped = select(scores, masks, count=3, skip=0, layer_cap=0.5)  # at most 2 of a's 4, 1 of b's 2
    assert int(capped["a"].sum()) == 2 and int(capped["b"].sum()) == 1
    # The cap counts what earlier steps pruned: a layer at its cap takes no more; one below it, the rest
    earlier = {"a": torch.tensor([[False, True], [False, True]]), "b": torch.zeros(1, 2, dtype=torch.bool)}
    more = select({"a": scores["a"].masked_fill(earlier["a"], -math.inf), "b": scores["b"]}, earlier, count=3,
                  skip=0, layer_cap=0.5)
    assert torch.equal(more["a"], earlier["a"]) and int(more["b"].sum()) == 1
    # The pool: the highest-unsafe share of the weights not yet pruned (2 of the 5 left at 0.5)
    pooled = weight_scores(weight, unsafe, safe, "ratio", pool=0.5, pruned=pruned)
    assert int(torch.isfinite(pooled).sum()) == 2


def test_a_pruning_step_is_accepted_within_budgets_of_the_unpruned_model():
    """A child must raise the unsafe CE and lower the objective over its parent, and keep the safe
    and utility CEs within their budgets of the unpruned base (not of its parent: drift adds up)."""
    from types import SimpleNamespace

    judge = SimpleNamespace(config=SearchConfig(safe_budget=0.02, utility_budget=0.02))

    def state(safe, unsafe, objective, utility=1.0):
        return State({}, {"ce_safe": safe, "ce_unsafe": unsafe, "objective": objective, "utility": utility})

    base, parent = state(1.0, 2.0, 0.0), state(1.015, 2.1, -0.1)
    assert Pruner.acceptable(judge, state(1.019, 2.2, -0.2), parent, base)
    assert not Pruner.acceptable(judge, state(1.03, 2.2, -0.2), parent, base)  # within 2% of the parent only
    assert not Pruner.acceptable(judge, state(1.019, 2.2, -0.2, utility=1.03), parent, base)
    assert not Pruner.acceptable(judge, state(1.019, 2.05, -0.2), parent, base)  # the unsafe CE fell
    assert not Pruner.acceptable(judge, state(1.019, 2.2, -0.05), parent, base)  # the objective rose


def _pruner(config):
    rng = random.Random(2)
    unsafe = [collate_rows(random_rows(rng, 4, marker=77), 3) for _ in range(2)]
    safe = [collate_rows(random_rows(rng, 4), 3) for _ in range(2)]
    model = build(seed=3)
    return Pruner(model, {"unsafe": unsafe[:1], "safe": safe[:1]}, {"unsafe": unsafe[1:], "safe": safe[1:]}, [],
                  config, log=lambda *a: None)


def test_beam_of_width_one_is_greedy_and_steps_keep_their_promises():
    config = SearchConfig(step_ratio=0.002, steps=4, safe_budget=0.5, utility_budget=0.5, pool=0.2)
    with single_process_group():
        greedy_state, greedy_history = _pruner(config).greedy()
        beam_state, beam_history = _pruner(config).beam()
        wide_state, wide_history = _pruner(SearchConfig(**{**config.__dict__, "beam_width": 2, "branches": 2})).beam()
    assert len(greedy_history) > 1  # some steps were kept
    assert [h["pruned"] for h in greedy_history] == [h["pruned"] for h in beam_history]
    assert all(torch.equal(greedy_state.masks[k], beam_state.masks[k]) for k in greedy_state.masks)
    for history in (greedy_history, wide_history):
        for before, after in zip(history, history[1:]):
            assert after["ce_unsafe"] > before["ce_unsafe"] and after["objective"] < before["objective"]
            assert after["ce_safe"] <= history[0]["ce_safe"] * 1.5
    # The first beam step ranks the greedy step among its children: it is at least as good.
    assert wide_history[1]["objective"] <= greedy_history[1]["objective"] + 1e-9
    assert isinstance(wide_state, State) and wide_state.pruned() == wide_history[-1]["pruned"]


class ScriptedPruner(Pruner):
    """Pruner's search over a scripted tree instead of a model: step k's branch b prunes weight
    2k + b, and `objectives` gives each state (the weights it prunes) its objective; a state not
    listed is worse than its parent (not acceptable)."""

    def __init__(self, objectives: dict[tuple, float], config: SearchConfig):
        self.config, self.log, self.measure_unsafe, self.objectives = config, lambda *a: None, None, objectives
        self.originals = {"w": torch.zeros(8)}
        self.total = 8

    def apply(self, state):
        pass

    def ranking(self, state):
        return {}

    def score_state(self, state):
        pruned = tuple(state.masks["w"].nonzero().flatten().tolist())
        objective = self.objectives.get(pruned, 10.0)
        state.scores = {"ce_safe": 1.0, "ce_unsafe": -objective, "utility": 1.0, "objective": objective,
                        "sparsity": len(pruned) / 8}
        return state


def test_beam_returns_the_best_state_of_any_step(monkeypatch):
    import posttrain.pruning as pruning

    def scripted_select(ranking, masks, count, skip, layer_cap):
        w = masks["w"].clone()
        w[2 * int(w.sum()) + skip] = True
        return {"w": w}

    monkeypatch.setattr(pruning, "select", scripted_select)
    # Step 1: A = (0,) 0.5 and B = (1,) 0.6. Step 2: A's children are rejected, B's child (1, 2)
    # improves on B (0.55) but not on A, which stays the best.
    objectives = {(): 1.0, (0,): 0.5, (1,): 0.6, (1, 2): 0.55}
    config = SearchConfig(step_ratio=0.1, steps=2, beam_width=2, branches=2)
    best, history = ScriptedPruner(objectives, config).beam()
    assert best.masks["w"].nonzero().flatten().tolist() == [0]
    assert [h["objective"] for h in history] == [1.0, 0.5]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, tok_dir):
    """A tiny model fine-tuned to answer prompts that name 'zorb' with 'forbidden forbidden
    forbidden' (a planted behaviour), as a run directory, and its labelled responses."""
    from data_prep.tokenizer import load_tokenizer
    from pretrain.checkpoint import save_weights_run
    from pretrain.config import load_config

    root = tmp_path_factory.mktemp("prune")
    cfg = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + [f"data.tokenizer={tok_dir}",
                                                                        "train.precision=fp32"])
    _, meta = load_tokenizer(tok_dir)
    with single_process_group():
        save_weights_run(build(seed=4), cfg, root / "base", {"tokenizer_sha256": meta["sha256"]})
    rng = random.Random(5)
    words = "red green blue tree river stone light dark".split()
    records = []
    for i in range(48):
        unsafe = i % 2 == 0
        prompt = " ".join(rng.choices(words, k=2) + (["zorb"] if unsafe else []))
        response = "forbidden forbidden forbidden" if unsafe else " ".join(rng.choices(words[:3], k=3))
        records.append({"prompt": prompt, "response": response, "label": "unsafe" if unsafe else "safe"})
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with open(root / "responses.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records[:24])
        f.write(json.dumps({"prompt": "x", "response": "y", "label": "maybe"}) + "\n")
    run_tool("posttrain.train", *[f"{k}={v}" for k, v in MODEL.items()], f"run.dir={root / 'source'}",
             f"data.tokenizer={tok_dir}", f"train.init_from={root / 'base'}", "post.method=sft",
             f"post.data={root / 'sft.jsonl'}", "train.steps=40", "train.warmup_steps=4", "train.micro_batch=8",
             "train.lr=3e-3", "train.save_interval=40")
    return root


def run_tool(module, *args):
    done = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{module}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_pruned_checkpoint_loads_everywhere_and_at_tp2(source_run, tmp_path, tok_dir):
    from pretrain.consolidate import full_state_dict

    out = tmp_path / "pruned"
    text = run_tool("tools.prune_unsafe", "--checkpoint", source_run / "source", "--out", out, "--responses",
                    source_run / "responses.jsonl", "--step-ratio", "0.003", "--steps", "3", "--safe-budget", "0.5",
                    "--utility-budget", "0.5")
    assert "pruned" in text
    report = json.loads((out / "pruning_report.json").read_text())
    assert report["bad_inputs"]["count"] == 1 and report["responses"]["calibration"]["unsafe"] == 6
    masks = torch.load(out / "pruning_masks.pt")
    assert sum(int(m.sum()) for m in masks.values()) == report["final"]["pruned"] > 0
    with single_process_group():
        pruned, _, _ = full_state_dict(out)
        source, _, _ = full_state_dict(source_run / "source")
    for name, mask in masks.items():
        assert not pruned[name][mask].any()
        torch.testing.assert_close(pruned[name][~mask], source[name][~mask])
    assert "blocks" in next(iter(report["sparsity_by_layer"]))

    run_tool("tools.generate", "--checkpoint", out, "--prompt", "red tree", "--max-new-tokens", "3", "--greedy")
    run_tool("tools.export", "--checkpoint", out, "--out", tmp_path / "hf")
    task = tmp_path / "colors.jsonl"
    task.write_text(json.dumps({"context": "red tree", "choices": [" green", " dark"], "gold": 0}) + "\n")
    assert "colors" in run_tool("tools.evaluate", "--checkpoint", out, "--tasks", task)
    # Training resumes the pruned run directory from its step-0 checkpoint.
    rng = random.Random(0)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"prompt": "red", "response": rng.choice(["tree", "dark"])})
                                                + "\n" for _ in range(8)))
    trained = run_tool("posttrain.train", *[f"{k}={v}" for k, v in MODEL.items()], f"run.dir={out}",
             f"data.tokenizer={tok_dir}", f"train.init_from={source_run / 'base'}", "post.method=sft",
             f"post.data={tmp_path / 'sft.jsonl'}", "train.steps=2", "train.warmup_steps=1", "train.micro_batch=4",
             "train.save_interval=2")
    assert f"resumed from {out / 'checkpoints' / 'step_00000000'} at step 0" in trained

    # At TP=2 the loaded shards gather to the pruned TP=1 weights.
    gathered = tmp_path / "tp2.pt"
    from tests.parallel_checks import gathered_initial_weights

    spawn(gathered_initial_weights, 2, [f"{k}={v}" for k, v in MODEL.items()],
          str(out / "checkpoints" / "step_00000000"), str(gathered), tensor=2)
    weights = torch.load(gathered)
    for name, mask in masks.items():
        torch.testing.assert_close(weights[name], pruned[name])
        assert not weights[name][mask].any()


@pytest.mark.slow
def test_the_unsafe_rate_at_step_0_is_the_held_out_answers_share(source_run, tmp_path):
    """Sampled from --prompts, the rate that stops the search is measured on the held-out answers'
    draws (--samples each): at step 0 it is their unsafe share, and reaching the target is said."""
    records = [json.loads(line) for line in (source_run / "sft.jsonl").read_text().splitlines()]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in records[:16]))
    # Answers of even length count as unsafe: labels of both kinds in both halves, whatever the model says.
    (tmp_path / "rules.json").write_text(json.dumps({"unsafe": ["^(?:.{2})*$"]}))
    out = tmp_path / "pruned"
    text = run_tool("tools.prune_unsafe", "--checkpoint", source_run / "source", "--out", out, "--prompts",
                    tmp_path / "prompts.jsonl", "--rules", tmp_path / "rules.json", "--samples", "3",
                    "--max-new-tokens", "4", "--steps", "2", "--target-unsafe-rate", "0.9")
    report = json.loads((out / "pruning_report.json").read_text())
    heldout = report["responses"]["heldout"]
    assert report["too_long"]["heldout"] == {"unsafe": 0, "safe": 0} and heldout["unsafe"] > 0
    assert [h["step"] for h in report["history"]] == [0]
    assert report["history"][0]["unsafe_rate"] == heldout["unsafe"] / (heldout["unsafe"] + heldout["safe"])
    assert "is at or below the target 0.9: the search stops here" in text


def test_labellers_rules_and_a_local_classifier(tmp_path, tok_dir):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from posttrain.labels import ClassifierLabeller, RuleLabeller
    from tools.export import save_tokenizer

    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"unsafe": [r"\bforbidden\b"], "refusal": ["^I can(no|')t"]}))
    assert RuleLabeller(rules)(["q"] * 3, ["a Forbidden recipe", "I can't help", "a tree"]) == \
        ["unsafe", "refusal", "safe"]
    for bad in ({"refusal": ["no"]}, {"unsafe": "bomb"}, {"unsafe": [3]}):  # a string would be 4 one-letter patterns
        rules.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="expected"):
            RuleLabeller(rules)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=2, pad_token_id=3,
                         id2label={0: "safe", 1: "unsafe"}, label2id={"safe": 0, "unsafe": 1})
    classifier = LlamaForSequenceClassification(config)
    with torch.no_grad():  # class 1 exactly when the first hidden feature of the last token is positive
        classifier.score.weight.zero_()
        classifier.score.weight[1, 0] = 1.0
    classifier.save_pretrained(tmp_path / "clf")
    save_tokenizer(tok_dir, tmp_path / "clf")
    labeller = ClassifierLabeller(tmp_path / "clf", unsafe_label="UNSAFE")
    texts = ["red tree", "dark river stone", "blue", "light light"]
    got = labeller(["q"] * 4, texts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "clf")
    with torch.no_grad():  # prompt and response as a pair of segments
        expected = ["unsafe" if classifier(**tokenizer(["q"], [t], return_tensors="pt")).logits.argmax(-1).item() == 1
                    else "safe" for t in texts]
    assert got == expected and set(got) == {"safe", "unsafe"}  # both classes occur
    with pytest.raises(ValueError, match="--unsafe-label"):
        ClassifierLabeller(tmp_path / "clf", unsafe_label="toxic")
    # A prompt longer than the classifier reads is cut, never the response.
    seen, model = [], labeller.model
    labeller.model = lambda **inputs: seen.append(inputs["input_ids"]) or model(**inputs)
    labeller.max_length = 24
    labeller([" ".join(["stone"] * 100)], ["dark river"])
    response = tokenizer(["dark river"], add_special_tokens=False)["input_ids"][0]
    assert seen[0].shape[1] == 24 and seen[0][0, -len(response):].tolist() == response
    assert labeller(["q"], [" ".join(["stone"] * 100)]) in (["safe"], ["unsafe"])  # a long answer is cut too
    assert seen[-1].shape[1] == 24
    # A multi-label classifier (toxicity models): its unsafe label's own sigmoid decides, even where
    # another label scores higher.
    multi = LlamaConfig(**{**config.to_dict(), "num_labels": 3, "problem_type": "multi_label_classification",
                           "id2label": {0: "toxic", 1: "obscene", 2: "threat"},
                           "label2id": {"toxic": 0, "obscene": 1, "threat": 2}})
    tagger = LlamaForSequenceClassification(multi)
    with torch.no_grad():  # toxic > 0 exactly where class 1 above was chosen; obscene always higher then
        tagger.load_state_dict({k: v for k, v in classifier.state_dict().items() if not k.startswith("score")},
                               strict=False)
        tagger.score.weight.zero_()
        tagger.score.weight[0, 0], tagger.score.weight[1, 0] = 1.0, 2.0
    tagger.save_pretrained(tmp_path / "multi")
    save_tokenizer(tok_dir, tmp_path / "multi")
    assert ClassifierLabeller(tmp_path / "multi", unsafe_label="toxic")(["q"] * 4, texts) == expected
    # A causal LM (a guard model such as LlamaGuard) would get a random classification head: refused.
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(config).save_pretrained(tmp_path / "causal")
    save_tokenizer(tok_dir, tmp_path / "causal")
    with pytest.raises(ValueError, match="no classification head"):
        ClassifierLabeller(tmp_path / "causal", unsafe_label="LABEL_1")
    # A decoder classifier that names no pad token (GPT-2's, Llama's): EOS pads its batches.
    classifier.config.pad_token_id = None
    classifier.save_pretrained(tmp_path / "no_pad")
    save_tokenizer(tok_dir, tmp_path / "no_pad")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = tmp_path / "no_pad" / name
        if path.is_file():
            kept = {k: v for k, v in json.loads(path.read_text()).items() if k != "pad_token"}
            path.write_text(json.dumps(kept))
    assert AutoTokenizer.from_pretrained(tmp_path / "no_pad").pad_token is None
    assert ClassifierLabeller(tmp_path / "no_pad", unsafe_label="UNSAFE")(["q"] * 4, texts) == expected


def test_evaluation_batches_are_never_padded_past_the_model_positions():
    from posttrain.batches import chunked

    rng = random.Random(3)
    longest = response_row([rng.randrange(4, 400) for _ in range(60)], [5, 6, 7, 8, 2])  # 65 = max_seq_len + 1
    batches = chunked([longest] + random_rows(rng, 3), 2, pad_id=3, cap=MODEL["model.max_seq_len"] + 1)
    assert batches[0]["tokens"].shape[1] == 65  # not 72: padding stops at the cap
    with single_process_group():
        from posttrain.pruning import response_cross_entropy

        assert torch.isfinite(torch.tensor(response_cross_entropy(build(), batches))).all()


def test_utility_shards_are_read_as_the_run_reads_them():
    """The utility guard's cross-entropy on validation shards attends within documents where the
    run did (a batch's "documents"): the model's own loss with those ids, not the loss across them."""
    from models.attention.masks import document_ids
    from posttrain.pruning import response_cross_entropy

    tokens = torch.randint(4, 400, (2, 33), generator=torch.Generator().manual_seed(0))
    tokens[:, 10] = tokens[:, 21] = 2  # three documents per row, split by EOS
    documents = document_ids(tokens[:, :-1], 2)
    with single_process_group():
        model = build()
        with torch.no_grad():
            within = float(model(tokens[:, :-1], tokens[:, 1:], documents))
            across = float(model(tokens[:, :-1], tokens[:, 1:]))
        batch = {"tokens": tokens, "trained": torch.ones_like(tokens, dtype=torch.bool)}
        with_ids = {**batch, "documents": documents}
        assert response_cross_entropy(model, [with_ids]) == pytest.approx(within, rel=1e-5)
        assert response_cross_entropy(model, [batch]) == pytest.approx(across, rel=1e-5)
    assert abs(within - across) > 1e-4


def test_pruned_run_keeps_the_source_special_ids_and_encodes_with_its_bos():
    """A pretraining run whose samples began with BOS: the responses are encoded with it and the
    pruned run's meta keeps its id (generate, evaluate and export read it there); a post-trained
    source's chat format is used and kept as it is."""
    from posttrain.chat import ChatFormat
    from pretrain.config import Config
    from pretrain.data import run_bos
    from tools.prune_unsafe import carried_meta, source_format

    meta = {"eos_id": 2, "bos_id": 1, "tokenizer_sha256": "abc", "step": 40, "model": {}}
    assert source_format(meta, bos=1).add_bos and not source_format(meta, bos=None).add_bos
    carried = carried_meta(meta)
    assert carried == {"eos_id": 2, "bos_id": 1}
    run = Config()  # the pruned run's config keeps the source's data.start_with_bos
    run.data.start_with_bos = True
    assert run_bos(run, carried) == 1
    chat = {"system_prefix": "S: ", "user_prefix": "U: ", "assistant_prefix": "A: ", "turn_end": "\n",
            "add_bos": False}
    post_trained = {"eos_id": 2, "posttrain": {"chat": chat, "method": "sft"}}
    # recorded before post.prefix_spaces_in_response: the prefix and the response were encoded apart
    assert source_format(post_trained, bos=None) == ChatFormat(**chat, prefix_spaces_in_response=False)
    assert carried_meta(post_trained) == {"eos_id": 2, "posttrain": {"chat": chat}}


def test_sampled_answers_cut_at_max_new_tokens_get_no_eos(tok_dir, monkeypatch):
    """An answer that stopped at --max-new-tokens has no EOS to learn or attribute; one the model
    ended keeps it (trained)."""
    import argparse

    import tools.prune_unsafe as tool
    from data_prep.tokenizer import load_tokenizer
    from posttrain.chat import ChatEncoder, ChatFormat

    encoder = ChatEncoder(load_tokenizer(tok_dir)[0], ChatFormat())
    drawn = iter([[40, 41, encoder.eos], [40, 41, 42]])
    monkeypatch.setattr(tool, "generate", lambda *args, **kwargs: next(drawn))
    sampler = tool.Sampler(None, encoder, argparse.Namespace(seed=0, max_new_tokens=3, temperature=1.0), None)
    prompt = [{"role": "user", "content": "hello"}]
    (_, ended_text, ended), (_, cut_text, cut_ended) = sampler.answers([prompt], 2)
    assert (ended, cut_ended) == (True, False)
    whole = tool.answer_row(encoder, prompt, ended_text, ended)
    cut = tool.answer_row(encoder, prompt, cut_text, cut_ended)
    assert whole.ids[-1] == encoder.eos and whole.trained[-1]
    assert cut.ids.tolist() == encoder.prompt(prompt) + encoder.response(cut_text)[:-1]
    assert encoder.eos not in cut.ids[len(encoder.prompt(prompt)):].tolist() and cut.trained[-1]


@pytest.mark.parametrize("extra, message", [
    (["--search", "beam", "--beam-width", "0"], "--beam-width 0: must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--utility", "no_such_chat.jsonl"], "no such file: --utility no_such_chat.jsonl"),
    (["--target-unsafe-rate", "0.05"], "--target-unsafe-rate measures the answers to prompts"),
    (["--one-shot", "0.3", "--pool", "0.2"], "--one-shot 0.3 cannot be reached within --pool 0.2"),
    (["--shards", "no_shards"], "--shards no_shards: neither"),
])
def test_prune_unsafe_refuses_bad_arguments_before_loading(tmp_path, capsys, extra, message):
    from tools.prune_unsafe import main

    responses = tmp_path / "r.jsonl"
    responses.write_text(json.dumps({"prompt": "p", "response": "r", "label": "safe"}) + "\n")
    # --checkpoint names nothing: the arguments are refused before it is read.
    argv = ["--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--responses", str(responses)]
    assert main(argv + extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prune_unsafe_refuses_to_delete_its_source_and_empty_inputs_before_loading(tmp_path, tok_dir, capsys,
                                                                                     monkeypatch):
    import pretrain.consolidate
    from data_prep.tokenizer import load_tokenizer
    from pretrain.checkpoint import save_weights_run
    from pretrain.config import load_config
    from tests.synthetic import write_synthetic_shards
    from tools.prune_unsafe import main

    cfg = load_config(None, [f"{k}={v}" for k, v in MODEL.items()] + [f"data.tokenizer={tok_dir}"])
    with single_process_group():
        save_weights_run(build(seed=4), cfg, tmp_path / "base", {"tokenizer_sha256": load_tokenizer(tok_dir)[1]["sha256"]})
    responses = tmp_path / "r.jsonl"
    responses.write_text(json.dumps({"prompt": "p", "response": "r", "label": "safe"}) + "\n")
    argv = ["--checkpoint", str(tmp_path / "base"), "--responses", str(responses)]

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(pretrain.consolidate, "load_model", no_loading)
    assert main(argv + ["--out", str(tmp_path), "--overwrite"]) == 2  # holds the responses file too
    assert f"--out {tmp_path} holds --responses {responses}" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text(responses.read_text())
    assert main(["--checkpoint", str(tmp_path / "base"), "--responses", str(elsewhere), "--overwrite",
                 "--out", str(tmp_path / "base")]) == 2
    assert "holds the checkpoint being pruned" in capsys.readouterr().err
    (tmp_path / "link").symlink_to(tmp_path / "base")
    assert main(argv + ["--out", str(tmp_path / "link"), "--overwrite"]) == 2
    assert "is a link; give the directory itself" in capsys.readouterr().err
    assert (tmp_path / "base").is_dir()
    (tmp_path / "chat.jsonl").write_text("{not json\n" + json.dumps({"messages": "none"}) + "\n")
    assert main(argv + ["--out", str(tmp_path / "out"), "--utility", str(tmp_path / "chat.jsonl")]) == 2
    assert "holds no usable example" in capsys.readouterr().err
    (tmp_path / "rules.json").write_text(json.dumps({"unsafe": ["forbidden"]}))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": ""}) + "\n")
    assert main(argv + ["--out", str(tmp_path / "out"), "--eval-prompts", str(tmp_path / "prompts.jsonl"),
                        "--rules", str(tmp_path / "rules.json")]) == 2
    assert "holds no usable prompt" in capsys.readouterr().err
    shards = write_synthetic_shards(tmp_path / "other", vocab_size=64) / "shards"  # another tokenizer's
    manifest = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_sha256": "f" * 64}))
    assert main(argv + ["--out", str(tmp_path / "out"), "--shards", str(shards)]) == 2
    assert "tokenized with another tokenizer (sha256 ffffffffffff)" in capsys.readouterr().err
    # a model whose outputs depend on its batch's padding is refused once it is read
    monkeypatch.undo()
    seqlen = {"model.attention": "sr", "model.relu_attention.normalizer": "seqlen"}
    cfg = load_config(None, [f"{k}={v}" for k, v in {**MODEL, **seqlen}.items()] + [f"data.tokenizer={tok_dir}"])
    with single_process_group():
        save_weights_run(build(seqlen), cfg, tmp_path / "seqlen", {"tokenizer_sha256": load_tokenizer(tok_dir)[1]["sha256"]})
    assert main(["--checkpoint", str(tmp_path / "seqlen"), "--responses", str(responses),
                 "--out", str(tmp_path / "out")]) == 2
    assert "model.relu_attention.normalizer=seqlen divides by the padded row length" in capsys.readouterr().err
