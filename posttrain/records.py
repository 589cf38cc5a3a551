"""Post-training records as users have them on disk, checked field by field.

    sft         {"prompt": str | [messages ending with a user turn], "response" (or TRL's "completion"):
                 str | [the assistant's message]}
                {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}
                (ends with an assistant turn; every assistant turn is trained)
    preference  {"prompt": str | [messages ending with a user turn], "chosen": str, "rejected": str,
                 "scores": {objective: number in [0, 1]}}   (scores: the chosen response's; SGA needs them)
                TRL's conversational records too: "chosen" / "rejected" as messages ending with the
                assistant's response, after the prompt's turns or alone; without "prompt" the turns
                before the responses are the prompt (TRL's implicit prompt), the same in both

A record that breaks a rule raises BadRecord with the reason; readers count it and go on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from data_prep.readers import read_records
from data_prep.sources import BadInputReport

ROLES = ("system", "user", "assistant")


class BadRecord(ValueError):
    pass


@dataclass(frozen=True)
class Pair:
    prompt: list[dict]  # messages, the last one the user's
    chosen: str
    rejected: str
    scores: dict[str, float]  # objective -> the chosen response's score in [0, 1]; {} without scores


def text_field(value, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BadRecord(f"{name!r} must be a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRecord(f"{name!r} is not valid Unicode (lone surrogate)") from None
    return value


def _messages(value, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRecord(f"{name!r} must be a non-empty list of {{role, content}} messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRecord(f"{name}[{i}] must be {{'role': one of {'/'.join(ROLES)}, 'content': str}}")
        out.append({"role": message["role"], "content": text_field(message.get("content"), f"{name}[{i}].content")})
    return out


def sft_messages(rec: dict) -> list[dict]:
    if "messages" in rec:
        messages = _messages(rec["messages"], "messages")
        if messages[-1]["role"] != "assistant":
            raise BadRecord("'messages' must end with an assistant turn (the response to train)")
        return messages
    if "prompt" in rec or "response" in rec or "completion" in rec:
        key = "completion" if "completion" in rec else "response"  # TRL's prompt-completion records
        response, turns = _response(rec.get(key), key)
        if turns:
            raise BadRecord(f"{key!r} given as messages must hold the assistant's response alone")
        return [*prompt_messages(rec.get("prompt")), {"role": "assistant", "content": response}]
    raise BadRecord("expected 'prompt' and 'response' (or 'completion'), or 'messages'")


def prompt_messages(value) -> list[dict]:
    """A prompt given as text or as messages, as messages ending with the user's turn."""
    if isinstance(value, list):
        messages = _messages(value, "prompt")
        if messages[-1]["role"] != "user":
            raise BadRecord("a 'prompt' given as messages must end with a user turn")
        return messages
    return [{"role": "user", "content": text_field(value, "prompt")}]


def _response(value, name: str) -> tuple[str, list[dict] | None]:
    """(the response, the turns before it or None) of "chosen" / "rejected" as text or messages."""
    if not isinstance(value, list):
        return text_field(value, name), None
    messages = _messages(value, name)
    if messages[-1]["role"] != "assistant":
        raise BadRecord(f"{name!r} given as messages must end with the assistant's response")
    return messages[-1]["content"], messages[:-1]


def preference(rec: dict) -> Pair:
    """A preference record without its scores (DPO)."""
    (chosen, chosen_turns), (rejected, rejected_turns) = _response(rec.get("chosen"), "chosen"), \
        _response(rec.get("rejected"), "rejected")
    if "prompt" in rec:
        prompt = prompt_messages(rec["prompt"])
        for name, turns in (("chosen", chosen_turns), ("rejected", rejected_turns)):
            if turns and turns != prompt:
                raise BadRecord(f"the turns of {name!r} before its response are not the 'prompt'")
    else:  # TRL's implicit prompt: the turns both responses follow
        if not chosen_turns or rejected_turns is None:
            raise BadRecord("no 'prompt': give it, or 'chosen' and 'rejected' as messages after the prompt's turns")
        if chosen_turns != rejected_turns:
            raise BadRecord("'chosen' and 'rejected' differ before their last turn: give the prompt they share "
                            "(multi-turn responses are not trained)")
        prompt = prompt_messages(chosen_turns)
    return Pair(prompt, chosen, rejected, {})


def scored_preference(rec: dict) -> Pair:
    """A preference record with the chosen response's scores (SGA)."""
    pair = preference(rec)
    scores = rec.get("scores")
    if scores is None:
        raise BadRecord("no 'scores' (post.method=sga trains on them)")
    if not isinstance(scores, dict) or not scores:
        raise BadRecord("'scores' must map each objective to a number in [0, 1]")
    checked = {}
    for name, value in scores.items():
        # The range first: an integer too large for a float (JSON allows one) makes isfinite raise.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1 \
                or not math.isfinite(value):
            raise BadRecord(f"scores[{name!r}]={value!r} is not a number in [0, 1]")
        checked[str(name)] = float(value)
    return Pair(pair.prompt, pair.chosen, pair.rejected, checked)


def read(files: list[str], parse: Callable[[dict], object], report: BadInputReport) -> Iterator[tuple[object, str]]:
    """(parsed record, origin) of every good record of `files`, in order; bad ones are counted."""
    for path in files:
        for rec, where in read_records(Path(path), report):
            try:
                yield parse(rec), where
            except BadRecord as err:
                report.add(where, str(err))
