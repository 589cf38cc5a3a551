"""Rating files as published -> preference JSONL for post.method=dpo / sga (posttrain.records).

    python -m posttrain.convert helpsteer2 --input helpsteer2/train.jsonl.gz --out data/prefs/helpsteer2.jsonl
    python -m posttrain.convert ultrafeedback --input ultrafeedback/*.parquet --out data/prefs/uf.jsonl
    python -m posttrain.convert hh-rlhf --input hh-rlhf/train.jsonl.gz --out data/prefs/hh.jsonl

Responses are grouped by their exact prompt; for a prompt with at least two rated responses the
chosen one has the highest mean rating and the rejected one the lowest (the first in file order
among equal means); a prompt whose highest and lowest means are equal is dropped as a tie. The
chosen response's ratings, normalised to [0, 1] and rounded to 2 decimals, are its `scores`:

    helpsteer2     rows {prompt, response, helpfulness, correctness, coherence, complexity, verbosity}
                   with ratings 0-4 -> rating / 4; a multi-turn prompt ("...<extra_id_1>Assistant\\n...
                   <extra_id_1>User\\n...") becomes messages
    ultrafeedback  rows {instruction, completions: [{response, annotations: {aspect: {Rating}}}]} (the
                   published form) or one completion per row {prompt, completion | response,
                   annotations}; aspects helpfulness, honesty, instruction_following, truthfulness
                   rated 1-5 -> (rating - 1) / 4

Anthropic's hh-rlhf holds pairs already, as dialogues in plain text ("\\n\\nHuman: ...\\n\\nAssistant:
..."), without ratings (DPO only): each row {chosen, rejected} becomes {prompt: the turns both
dialogues share, as messages, chosen: the last assistant turn of one, rejected: of the other}, each
turn's text as written but for the space after its mark and trailing whitespace. Empty turns of
the prompt are left out (and counted). A row whose dialogues differ before their last turn, or do
not end with a non-empty assistant turn after a Human one, is a bad record; a row whose two
responses are the same text is dropped (it prefers neither).

A row or completion with a missing, non-numeric ("N/A") or out-of-range rating is counted and
skipped. Input: JSON Lines (.jsonl, .gz, .zst) or Parquet files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from data_prep.readers import FileReadError, read_records
from data_prep.sources import BadInputReport
from posttrain.records import BadRecord, preference, text_field

HELPSTEER2 = ("helpfulness", "correctness", "coherence", "complexity", "verbosity")
ULTRAFEEDBACK = ("helpfulness", "honesty", "instruction_following", "truthfulness")
TURN_MARK = "<extra_id_1>"
HH_TURN = re.compile(r"\n\n(Human|Assistant):")  # hh-rlhf's turn marks (a space follows, as a rule)
FORMATS = ("helpsteer2", "ultrafeedback", "hh-rlhf")


def _rating(value, low: int, high: int, name: str) -> float:
    try:
        rating = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer too large for a float
        raise BadRecord(f"{name} rating {value!r} is not a number") from None
    if not low <= rating <= high:
        raise BadRecord(f"{name} rating {rating:g} is outside {low}-{high}")
    return rating


def helpsteer2_prompt(text: str) -> str | list[dict]:
    """HelpSteer2's multi-turn prompts mark turns with <extra_id_1>Assistant / <extra_id_1>User lines."""
    if TURN_MARK not in text:
        return text
    first, *turns = text.split(TURN_MARK)
    messages = [{"role": "user", "content": first.strip()}]
    for turn in turns:
        role, _, content = turn.partition("\n")
        role = role.strip().lower()
        if role not in ("user", "assistant"):
            raise BadRecord(f"a multi-turn prompt has a turn {role!r}; expected User or Assistant")
        messages.append({"role": role, "content": content.strip()})
    if messages[-1]["role"] != "user" or any(not m["content"] for m in messages):
        raise BadRecord("a multi-turn prompt must end with a non-empty user turn")
    return messages


def helpsteer2_rows(rec: dict):
    prompt = text_field(rec.get("prompt"), "prompt")
    ratings = {a: _rating(rec.get(a), 0, 4, a) for a in HELPSTEER2}
    yield prompt, text_field(rec.get("response"), "response"), {a: r / 4 for a, r in ratings.items()}


def _either(rec: dict, *names: str):
    """The first of `names` that rec holds and is not null (Parquet structs carry every field)."""
    return next((rec[n] for n in names if rec.get(n) is not None), None)


def _ultrafeedback_completion(completion, report, where) -> tuple[str, dict] | None:
    try:
        if not isinstance(completion, dict):
            raise BadRecord("a completion is not an object")
        text = text_field(_either(completion, "response", "completion"), "response")
        annotations = completion.get("annotations")
        if not isinstance(annotations, dict):
            raise BadRecord("missing 'annotations'")
        ratings = {}
        for aspect in ULTRAFEEDBACK:
            entry = annotations.get(aspect)
            value = entry.get("Rating") if isinstance(entry, dict) else entry
            ratings[aspect] = (_rating(value, 1, 5, aspect) - 1) / 4
        return text, ratings
    except BadRecord as err:
        report.add(where, str(err))
        return None


def ultrafeedback_rows(rec: dict, report: BadInputReport, where: str):
    if rec.get("completions") is not None:  # the published form: every completion of a prompt in one row
        prompt = text_field(_either(rec, "instruction", "prompt"), "instruction")
        completions = rec["completions"]
        if not isinstance(completions, list):
            raise BadRecord(f"'completions' is {type(completions).__name__}; expected a list of completions")
        for i, completion in enumerate(completions):
            done = _ultrafeedback_completion(completion, report, f"{where} completion {i}")
            if done:
                yield prompt, *done
        return
    prompt = text_field(_either(rec, "prompt", "instruction"), "prompt")
    done = _ultrafeedback_completion(rec, report, where)
    if done:
        yield prompt, *done


def hh_dialogue(text, name: str) -> tuple[list[dict], int]:
    """An hh-rlhf dialogue ("\\n\\nHuman: ...\\n\\nAssistant: ...") as messages (each turn's text as
    written, less the space after its mark and trailing whitespace), and how many empty turns before
    the last were left out."""
    text = text_field(text, name)
    parts = HH_TURN.split("\n\n" + text.lstrip("\n"))  # ['', 'Human', content, 'Assistant', content, ...]
    if parts[0].strip() or len(parts) < 3 or parts[1] != "Human":
        raise BadRecord(f"{name!r} does not begin with a 'Human:' turn (expected \"\\n\\nHuman: ...\\n\\n"
                        f"Assistant: ...\")")
    turns = [{"role": "user" if role == "Human" else "assistant",
              "content": content.removeprefix(" ").rstrip()} for role, content in zip(parts[1::2], parts[2::2])]
    if turns[-1]["role"] != "assistant":
        raise BadRecord(f"{name!r} does not end with an assistant turn (the response)")
    text_field(turns[-1]["content"], f"{name}'s response")
    messages = [t for t in turns[:-1] if t["content"].strip()] + turns[-1:]
    return messages, len(turns) - len(messages)


def hh_rlhf_pair(rec: dict) -> tuple[dict, int]:
    """The preference record of an hh-rlhf row, and the empty turns its prompt left out."""
    (chosen, empty), (rejected, _) = hh_dialogue(rec.get("chosen"), "chosen"), hh_dialogue(rec.get("rejected"),
                                                                                          "rejected")
    if chosen[:-1] != rejected[:-1]:
        raise BadRecord("'chosen' and 'rejected' differ before their last turn (multi-turn responses are not "
                        "trained)")
    if len(chosen) < 2 or chosen[-2]["role"] != "user":
        raise BadRecord("the responses follow an assistant turn, not a 'Human:' one")
    pair = {"prompt": chosen[:-1], "chosen": chosen[-1]["content"], "rejected": rejected[-1]["content"]}
    preference(pair)  # as the trainer reads it
    return pair, empty


def pairs(responses: dict[str, list[tuple[str, dict]]], counts: dict) -> list[dict]:
    """{prompt: [(response, scores)]} -> preference records (see the module docstring)."""
    out = []
    for prompt, rated in responses.items():
        if len(rated) < 2:
            counts["single_response"] += 1
            continue
        means = [sum(s.values()) / len(s) for _, s in rated]
        best = max(range(len(rated)), key=lambda i: (means[i], -i))
        worst = min(range(len(rated)), key=lambda i: (means[i], i))
        if means[best] == means[worst]:
            counts["ties"] += 1
            continue
        key = json.loads(prompt)
        out.append({"prompt": key, "chosen": rated[best][0], "rejected": rated[worst][0],
                    "scores": {k: round(v, 2) for k, v in rated[best][1].items()}})
    return out


def convert(kind: str, inputs: list[str], out: Path, overwrite: bool = False) -> dict:
    if kind not in FORMATS:
        raise ValueError(f"unknown format {kind!r}: choose one of {', '.join(FORMATS)}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} exists; choose another file or pass --overwrite")
    missing = [p for p in inputs if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"--input: no such file {', '.join(missing)}")
    report = BadInputReport()
    responses: dict[str, list] = {}
    counts = {"single_response": 0, "ties": 0, "same_responses": 0, "empty_turns": 0}
    records = []  # hh-rlhf's, as they come
    rows = 0
    for path in inputs:
        for rec, where in read_records(Path(path), report):
            rows += 1
            try:
                if kind == "hh-rlhf":
                    pair, empty = hh_rlhf_pair(rec)
                    counts["empty_turns"] += empty
                    if pair["chosen"] == pair["rejected"]:
                        counts["same_responses"] += 1
                    else:
                        records.append(pair)
                    continue
                if kind == "helpsteer2":
                    found = list(helpsteer2_rows(rec))
                    found = [(helpsteer2_prompt(p), r, s) for p, r, s in found]
                else:
                    found = list(ultrafeedback_rows(rec, report, where))
            except BadRecord as err:
                report.add(where, str(err))
                continue
            for prompt, response, scores in found:
                responses.setdefault(json.dumps(prompt), []).append((response, scores))
    if kind != "hh-rlhf":
        records = pairs(responses, counts)
    if not records:
        found = (f"{counts['same_responses']} with the same response twice" if kind == "hh-rlhf" else
                 f"{len(responses)} prompts, {counts['ties']} ties, {counts['single_response']} with one response")
        raise ValueError(f"no preference pair in {', '.join(inputs)} ({rows} rows, {found}; {report.summary()})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    prompts = len(responses) if kind != "hh-rlhf" else len({json.dumps(r["prompt"]) for r in records})
    return {"rows": rows, "prompts": prompts, "pairs": len(records), **counts, "bad": report.to_dict(),
            "summary": report.summary()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrain.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("format", choices=FORMATS)
    parser.add_argument("--input", nargs="+", required=True, help="JSON Lines or Parquet files")
    parser.add_argument("--out", required=True, help="the preference JSONL to write")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        result = convert(args.format, args.input, Path(args.out), args.overwrite)
    except (ValueError, FileExistsError, FileNotFoundError, FileReadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dropped = (f"dropped {result['same_responses']} rows with the same response twice and "
               f"{result['empty_turns']} empty turns of prompts" if args.format == "hh-rlhf"
               else f"dropped {result['ties']} ties and {result['single_response']} prompts with one response")
    print(f"wrote {result['pairs']} pairs to {args.out} ({result['rows']} rows, {result['prompts']} prompts; "
          f"{dropped}; {result['summary']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
