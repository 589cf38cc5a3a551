"""Labelling model responses safe, unsafe or refusal, for unsafe-ticket pruning. Three sources:

    labelled JSONL   {"prompt": str | messages, "response": str, "label": "unsafe" | "safe" | "refusal"}
    rule file        JSON {"unsafe": [regex, ...], "refusal": [regex, ...]} (case-insensitive; a response
                     matching an unsafe pattern is unsafe, else one matching a refusal pattern a refusal,
                     else safe)
    classifier       a local Hugging Face sequence-classification model directory, run with
                     transformers on "prompt\\nresponse"; the label named --unsafe-label (from its
                     config's id2label) means unsafe, anything else safe
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from data_prep.sources import BadInputReport
from posttrain import records

LABELS = ("unsafe", "safe", "refusal")


class RuleLabeller:
    def __init__(self, path: str | Path):
        try:
            rules = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"rule file {path}: {err}") from None
        lists = isinstance(rules, dict) and all(isinstance(v, list) and all(isinstance(p, str) for p in v)
                                                for v in rules.values())
        if not lists or not rules.get("unsafe") or set(rules) - {"unsafe", "refusal"}:
            # a string where a list belongs would be split into one-character patterns
            raise ValueError(f"rule file {path}: expected {{\"unsafe\": [regex, ...], \"refusal\": [regex, ...]}}")
        try:
            self.unsafe = [re.compile(p, re.IGNORECASE) for p in rules["unsafe"]]
            self.refusal = [re.compile(p, re.IGNORECASE) for p in rules.get("refusal", [])]
        except re.error as err:
            raise ValueError(f"rule file {path}: bad pattern ({err})") from None

    def __call__(self, prompts: list[str], responses: list[str]) -> list[str]:
        def label(text: str) -> str:
            if any(p.search(text) for p in self.unsafe):
                return "unsafe"
            return "refusal" if any(p.search(text) for p in self.refusal) else "safe"

        return [label(r) for r in responses]


class ClassifierLabeller:
    """A sequence-classification model's verdict on each (prompt, response) pair, the pair encoded
    as two segments, the longer one truncated first (a long prompt never hides the response). A
    multi-label model (config.problem_type multi_label_classification, as most toxicity
    classifiers) calls a response unsafe when the unsafe label's sigmoid passes `threshold`; a
    single-label one when it is the most likely class."""

    def __init__(self, model_dir: str | Path, unsafe_label: str = "unsafe", batch_size: int = 16,
                 threshold: float = 0.5):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(model_dir)
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.model, loading = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                                                     output_loading_info=True)
        except (OSError, ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"classifier {model_dir}: cannot load a tokenizer and a sequence-classification model "
                             f"from it ({type(err).__name__}: {err}); give a directory written by save_pretrained "
                             "of both") from None
        self.model.eval()
        if loading["missing_keys"]:  # a causal LM (a guard model such as LlamaGuard) gets a random head
            raise ValueError(f"classifier {model_dir}: its weights have no classification head ({config.architectures}"
                             f" is not a sequence classifier; missing {loading['missing_keys'][:3]}); give a model "
                             "trained for sequence classification (a generative guard model needs its own judge)")
        # Batches are padded; decoder classifiers (GPT-2, Llama) often name no pad token: EOS pads,
        # and the model then finds each row's last real token by it.
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"classifier {model_dir}: its tokenizer has neither a pad nor an EOS token to "
                                 "pad batches with; add a pad_token to its tokenizer_config.json")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        names = {int(i): str(n).lower() for i, n in self.model.config.id2label.items()}
        if len(names) < 2:
            raise ValueError(f"classifier {model_dir}: one output ({sorted(names.values())}) says nothing about "
                             "which side is unsafe; give a model with a named unsafe class")
        matches = [i for i, n in names.items() if n == unsafe_label.lower()]
        if not matches:
            raise ValueError(f"classifier {model_dir}: no label {unsafe_label!r} among {sorted(names.values())}; "
                             "pass --unsafe-label with the name of its unsafe class")
        self.unsafe_id, self.batch_size, self.threshold = matches[0], batch_size, threshold
        self.multi_label = self.model.config.problem_type == "multi_label_classification"
        limits = [n for n in (self.tokenizer.model_max_length, getattr(self.model.config, "max_position_embeddings",
                                                                        None)) if n and n < 1_000_000]
        self.max_length = min(limits) if limits else None

    def __call__(self, prompts: list[str], responses: list[str]) -> list[str]:
        import torch

        out = []
        for start in range(0, len(responses), self.batch_size):
            inputs = self.tokenizer(list(prompts[start:start + self.batch_size]),
                                    list(responses[start:start + self.batch_size]), return_tensors="pt",
                                    padding=True, truncation="longest_first" if self.max_length else False,
                                    max_length=self.max_length)
            with torch.no_grad():
                logits = self.model(**inputs).logits.float()
            if self.multi_label:
                unsafe = (torch.sigmoid(logits[:, self.unsafe_id]) > self.threshold).tolist()
            else:
                unsafe = (logits.argmax(-1) == self.unsafe_id).tolist()
            out += ["unsafe" if u else "safe" for u in unsafe]
        return out


def labelled(rec: dict) -> tuple[list[dict], str, str]:
    label = rec.get("label")
    if label not in LABELS:
        raise records.BadRecord(f"'label' must be one of {', '.join(LABELS)}")
    return (records.prompt_messages(rec.get("prompt")), records.text_field(rec.get("response"), "response"), label)


def read_labelled(files: list[str], report: BadInputReport) -> list[tuple[list[dict], str, str]]:
    return [value for value, _ in records.read(files, labelled, report)]


def read_prompts(files: list[str], report: BadInputReport) -> list[list[dict]]:
    return [value for value, _ in records.read(files, lambda rec: records.prompt_messages(rec.get("prompt")), report)]
