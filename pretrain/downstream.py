"""Multiple-choice downstream tasks scored by log-likelihood, as lm-evaluation-harness scores them.

A task is a local JSON Lines file; each record is one question in any of these shapes:

    ours        {"context": ..., "choices": [...], "gold": i}   ("query"/"question" for context, "label"/"answer" for gold)
    HellaSwag   {"ctx": ..., "endings": [...], "label": i}
    ARC         {"question": ..., "choices": {"text": [...], "label": ["A", ...]}, "answerKey": "A"}
    PIQA        {"goal": ..., "sol1": ..., "sol2": ..., "label": i}

Each choice is scored by the summed log-probability of its tokens (those of context + " " + choice
after the context's, as lm-eval takes them) after the context;
``acc`` picks the highest sum, ``acc_norm`` the highest sum per character of the choice (lm-eval's
acc_norm). Requests are spread over the data-parallel ranks, every rank doing the same number of
forwards (tensor- and expert-parallel collectives); the log-probabilities come from the
vocab-parallel cross-entropy over the real vocabulary (the padding columns masked, as an export has
none), so tensor-parallel logits are never gathered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from data_prep.sources import BadInputReport
from models.attention.relu import reads_row_length

CONTEXT_KEYS = ("context", "query", "question", "ctx", "goal")


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int


def parse_example(rec: dict) -> Example:
    """One record in any of the shapes above; ValueError names what is wrong."""
    if not isinstance(rec, dict):
        raise ValueError(f"the line is not a JSON object but a {type(rec).__name__}")
    context = next((rec[k] for k in CONTEXT_KEYS if isinstance(rec.get(k), str)), None)
    if context is None:
        raise ValueError(f"no context ({' / '.join(CONTEXT_KEYS)})")
    choices = rec.get("choices", rec.get("endings"))
    labels = None
    if isinstance(choices, dict):  # ARC: {"text": [...], "label": [...]}
        choices, labels = choices.get("text"), choices.get("label")
    if choices is None and "sol1" in rec:  # PIQA
        choices = [rec["sol1"], rec.get("sol2")]
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
        raise ValueError("needs a list of at least two string choices")
    gold = next((rec[k] for k in ("gold", "label", "answer", "answerKey") if k in rec), None)
    if isinstance(gold, str) and labels is not None and gold in labels:
        gold = labels.index(gold)
    elif isinstance(gold, str) and gold.strip().isdigit():
        gold = int(gold)
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise ValueError(f"gold answer {gold!r} is not an index into the {len(choices)} choices")
    return Example(context, tuple(choices), gold)


def load_task(path: str | Path, limit: int = 0, report: BadInputReport | None = None) -> list[Example]:
    """The examples of a task file (the first ``limit``, 0 = all); bad records are counted and skipped."""
    report = report if report is not None else BadInputReport()
    examples = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                examples.append(parse_example(json.loads(raw)))
            except (ValueError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
                report.add(f"{path}:{lineno}", str(e).split("\n")[0])
                continue
            if limit and len(examples) >= limit:
                break
    return examples


SHAPES = ('{"context", "choices", "gold"}, HellaSwag {"ctx", "endings", "label"}, ARC {"question", '
          '"choices": {"text", "label"}, "answerKey"} or PIQA {"goal", "sol1", "sol2", "label"}')


def empty_task_error(paths: list[str | Path]) -> str | None:
    """Which task files hold no usable example (each read up to its first one), with the first
    reason and the accepted shapes; None when every file has one."""
    for path in paths:
        report = BadInputReport()
        if not load_task(path, limit=1, report=report):
            reasons = "; ".join(line.strip() for line in report.summary().splitlines()[:2])  # the count, the first
            return (f"{path} holds no usable example ({reasons}); each line must be a JSON object of one of these "
                    f"shapes: {SHAPES}")
    return None


def task_name(path: str | Path) -> str:
    name = Path(path).name
    for suffix in (".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def requests(examples: list[Example], sp, max_len: int,
             bos: int | None = None) -> list[tuple[list[int], int]]:
    """(tokens, continuation length) per choice of every example, the context cut from the left so
    that at most ``max_len`` + 1 tokens remain; `bos` (a model trained with data.start_with_bos)
    begins every context."""
    out = []
    first = [] if bos is None else [bos]
    for ex in examples:
        # As lm-eval: the context's trailing whitespace ("Answer: ", a newline) goes to the choice, and
        # the choice's tokens are those of the whole text after the context's own, so a tokenizer's
        # dummy prefix or a merge across the boundary cannot add a token of its own.
        kept = ex.context.rstrip()
        context = sp.encode(kept)
        for choice in ex.choices:
            cont = sp.encode(ex.context + " " + choice)[len(context):] or sp.encode(" " + choice)
            cont = cont[-max_len:]
            before = first + context or [sp.eos_id()]  # the first choice token needs something before it
            tokens = (before + cont)[-(max_len + 1):]
            if first and tokens[0] != bos:  # cut from the left: BOS stays first
                tokens = first + tokens[len(first):]
            out.append((tokens, len(cont)))
    return out


def real_vocabulary(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's vocab-parallel logits with the padding columns (ids >= vocab_size) at -inf: the
    distribution over real tokens, which an exported model (without those rows) gives."""
    width = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    padding = torch.arange(start, start + width, device=logits.device) >= vocab_size
    return logits.masked_fill(padding, float("-inf")) if bool(padding.any()) else logits


@torch.no_grad()
def choice_logprobs(model, reqs: list[tuple[list[int], int]], batch_size: int, device, pad_id: int = 0,
                    group=None) -> torch.Tensor:
    """Summed log-probability of each request's continuation, [len(reqs)] float64 on every rank.

    Request i is scored on data-parallel rank i % size of ``group`` (None: this process alone); every
    rank runs the same number of batches, padded where it has fewer requests. A model whose outputs
    depend on the row's length (ReLU attention's seqlen normaliser) scores each request alone,
    unpadded, so that its score does not depend on the other requests."""
    alone = reads_row_length(model.cfg)
    batch_size = 1 if alone else batch_size
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    mine = list(range(rank, len(reqs), size))
    batches = -(-len(mine) // batch_size)
    if group is not None:
        count = torch.tensor([batches], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        batches = int(count)
    width = max((len(t) for t, _ in reqs), default=2) - 1
    scores = torch.zeros(len(reqs), dtype=torch.float64, device=device)
    for b in range(batches):
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        rows = [reqs[i][0] for i in chunk] or [[pad_id, pad_id]]  # a padding forward keeps collectives in step
        row_width = len(rows[0]) - 1 if alone else width
        tokens = torch.full((len(rows), row_width + 1), pad_id, dtype=torch.long)
        for r, row in enumerate(rows):
            tokens[r, :len(row)] = torch.tensor(row)
        tokens = tokens.to(device)
        logits = real_vocabulary(model.logits(tokens[:, :-1]).float(), model.cfg.vocab_size)
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits, tokens[:, 1:])  # [rows, width]
        for r, i in enumerate(chunk):
            n, cont = len(reqs[i][0]), reqs[i][1]
            scores[i] = -nll[r, n - 1 - cont:n - 1].double().sum()
    if group is not None:
        dist.all_reduce(scores, group=group)
    return scores


def accuracy(examples: list[Example], logprobs: torch.Tensor) -> dict[str, float]:
    """acc (highest summed log-probability) and acc_norm (highest per character of the choice, as lm-eval
    divides; its acc_bytes would divide by UTF-8 bytes)."""
    correct = correct_norm = 0
    offset = 0
    for ex in examples:
        lp = logprobs[offset:offset + len(ex.choices)].tolist()
        offset += len(ex.choices)
        per_char = [v / max(len(c), 1) for v, c in zip(lp, ex.choices)]
        correct += max(range(len(lp)), key=lp.__getitem__) == ex.gold
        correct_norm += max(range(len(lp)), key=per_char.__getitem__) == ex.gold
    n = max(len(examples), 1)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "examples": len(examples)}


def evaluate_tasks(model, tasks: dict[str, list[Example]], sp, batch_size: int, device, group=None,
                   bos: int | None = None) -> dict:
    """{task: {acc, acc_norm, examples}} for every task; the same on every rank."""
    was_training = model.training
    model.eval()
    try:
        out = {}
        for name, examples in tasks.items():
            reqs = requests(examples, sp, model.cfg.max_seq_len, bos)
            pad = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
            out[name] = accuracy(examples, choice_logprobs(model, reqs, batch_size, device, pad, group))
        return out
    finally:
        model.train(was_training)
