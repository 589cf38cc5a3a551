"""Messages -> token ids with a mask of the tokens to train, and SGA's scores as prompt text.

Each turn is encoded on its own and the pieces concatenated, so the mask falls exactly on token
boundaries: prompt tokens are never trained, whatever the tokenizer would merge across a boundary.
An assistant turn's response is encoded together with the prefix and split after the prefix's own
tokens, the spaces that end the prefix going with the response: "Assistant: import os" trains
"Assistant:" | "▁import ▁os", as running text is tokenized, not "Assistant:▁" | "import ▁os"
(post.prefix_spaces_in_response; false: the prefix and the response encoded apart, as checkpoints
recorded before the key were trained).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChatFormat:
    system_prefix: str = "System: "
    user_prefix: str = "User: "
    assistant_prefix: str = "Assistant: "
    turn_end: str = "\n"
    add_bos: bool = False
    prefix_spaces_in_response: bool = True

    @classmethod
    def from_config(cls, post) -> ChatFormat:
        return cls(post.system_prefix, post.user_prefix, post.assistant_prefix, post.turn_end, post.add_bos,
                   post.prefix_spaces_in_response)

    @classmethod
    def recorded(cls, chat: dict) -> ChatFormat:
        """The format a checkpoint's meta records (posttrain.chat); one recorded before
        prefix_spaces_in_response existed encoded the prefix and the response apart."""
        return cls(**{**LEGACY_CHAT, **chat})


LEGACY_CHAT = {"prefix_spaces_in_response": False}  # what a recorded format without the key means


def inherit_chat_format(post, trained_with: dict | None) -> list[str]:
    """Set the chat keys of `post` left at their defaults to the format the start checkpoint was
    post-trained with (its meta's posttrain.chat), so that DPO or SGA after SFT renders examples as
    SFT did without restating the format. Returns a line per key taken, and per key set otherwise
    that differs from the checkpoint's."""
    trained_with = {**LEGACY_CHAT, **trained_with} if trained_with else {}
    default = ChatFormat()
    keys = {key: key for key in trained_with if hasattr(default, key)}
    defaults = {key: getattr(default, key) for key in keys}
    return inherit_settings(post, trained_with, keys, defaults, "chat format")


def inherit_settings(post, recorded: dict, keys: dict[str, str], defaults: dict, what: str) -> list[str]:
    """Set each post key left at its default (keys: recorded name -> post key; defaults: post key ->
    its default) to the value the start checkpoint recorded. Returns a line per key taken, and per
    key set otherwise that differs."""
    lines = []
    for name, key in keys.items():
        if name not in recorded:
            continue
        theirs, mine = recorded[name], getattr(post, key)
        if mine == theirs:
            continue
        if mine == defaults[key]:
            setattr(post, key, theirs)
            lines.append(f"post.{key}={theirs!r}: the start checkpoint's {what}")
        else:
            lines.append(f"post.{key}={mine!r} differs from the start checkpoint's {theirs!r}, the {what} it "
                         "was trained with")
    return lines


SCORE_KEYS = {"prefix": "score_prefix", "item": "score_item", "joiner": "score_joiner",
              "decimals": "score_decimals"}  # ScoreFormat's fields -> the post keys


@dataclass(frozen=True)
class ScoreFormat:
    prefix: str = "\nYour response must satisfy the following scores: "
    item: str = "<{name}_score:{value}>"
    joiner: str = " and "
    decimals: int = 2

    @classmethod
    def from_config(cls, post) -> ScoreFormat:
        return cls(post.score_prefix, post.score_item, post.score_joiner, post.score_decimals)

    def text(self, scores: dict[str, float]) -> str:
        return self.prefix + self.joiner.join(self.item.format(name=name, value=round(float(value), self.decimals))
                                              for name, value in scores.items())


def with_scores(messages: list[dict], scores: dict[str, float], fmt: ScoreFormat) -> list[dict]:
    """The messages with the scores' text appended to the last user turn."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = [dict(m) for m in messages]
    out[last]["content"] += fmt.text(scores)
    return out


def chat_template(fmt: ChatFormat, dummy_prefix: bool = False) -> str:
    """A Hugging Face chat template (Jinja) rendering the text ChatEncoder encodes: BOS where the
    format adds it, the system and user turns with their prefixes and turn end, an assistant turn's
    content followed by EOS, and as the generation prompt the assistant prefix as prompts end with
    it. ChatEncoder encodes turn by turn; a tokenizer encoding the rendered text at once may join
    pieces across a turn's boundary differently.

    `dummy_prefix` (a tokenizer that adds one, Llama-2's): ChatEncoder's every piece begins with
    the space SentencePiece adds, which running text has only at its start and after a special
    token (BOS, EOS), where the Hugging Face tokenizer adds it too: elsewhere the template writes it."""
    head = fmt.assistant_prefix.rstrip(" ") if fmt.prefix_spaces_in_response else fmt.assistant_prefix
    text = json.dumps  # a JSON string is a Jinja string literal
    space = text(" " if dummy_prefix else "")
    # ns.sep: what goes before the next piece ('' at the start and after EOS, else `space`)
    turn = "{{ ns.sep + %s + message['content'] + %s }}{%%- set ns.sep = %s %%}"
    reply = "{{ ns.sep + %s + %s + message['content'] + eos_token }}{%%- set ns.sep = '' %%}"
    body_sep = "''" if fmt.prefix_spaces_in_response else space  # the response: a piece of its own
    return ("{{ bos_token }}" if fmt.add_bos else "") + (
        "{%- set ns = namespace(sep='') %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' %}" + reply % (text(fmt.assistant_prefix), body_sep)
        + "{%- elif message['role'] == 'system' %}" + turn % (text(fmt.system_prefix), text(fmt.turn_end), space)
        + "{%- elif message['role'] == 'user' %}" + turn % (text(fmt.user_prefix), text(fmt.turn_end), space)
        + "{%- else %}{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ ns.sep + " + text(head) + " }}{%- endif %}")


class ChatEncoder:
    """Encodes messages with a SentencePiece processor (no BOS/EOS added by the processor)."""

    def __init__(self, sp, fmt: ChatFormat):
        self.sp, self.fmt = sp, fmt
        self.eos = sp.eos_id()
        self.bos = sp.bos_id() if fmt.add_bos else None  # what every example begins with, if anything
        self.prefixes = {"system": fmt.system_prefix, "user": fmt.user_prefix, "assistant": fmt.assistant_prefix}
        # What a prompt ends with: the assistant prefix, without the spaces its response takes.
        prefix = fmt.assistant_prefix
        self.head_text = prefix.rstrip(" ") if fmt.prefix_spaces_in_response else prefix
        self.head = self._ids(self.head_text)

    def _ids(self, text: str) -> list[int]:
        return self.sp.encode(text) if text else []

    def conversation(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, trained): every assistant turn's content and its EOS are trained, nothing else."""
        ids: list[int] = [self.bos] if self.bos is not None else []
        trained: list[bool] = [False] * len(ids)
        for message in messages:
            role, content = message["role"], message["content"]
            if role == "assistant":
                head, body = self.assistant_turn(content)
                ids += head + body
                trained += [False] * len(head) + [True] * len(body)
            else:
                piece = self._ids(self.prefixes[role] + content + self.fmt.turn_end)
                ids += piece
                trained += [False] * len(piece)
        return np.array(ids, dtype=np.int64), np.array(trained, dtype=bool)

    def assistant_turn(self, content: str) -> tuple[list[int], list[int]]:
        """(prefix ids, response ids with EOS) of an assistant turn; the prefix's trailing spaces are
        encoded with the response, so that its first word is the token running text has there."""
        prefix, head = self.prefixes["assistant"], list(self.head)
        if not self.fmt.prefix_spaces_in_response:
            return head, self._ids(content) + [self.eos]
        whole = self._ids(prefix + content)
        if whole[:len(head)] == head:
            return head, whole[len(head):] + [self.eos]
        return head, self._ids(prefix[len(self.head_text):] + content) + [self.eos]  # merged across the boundary

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids before a response: the turns, then the assistant prefix (without its trailing spaces)."""
        ids, _ = self.conversation(messages)
        return ids.tolist() + self.head

    def response(self, text: str) -> list[int]:
        return self.assistant_turn(text)[1]

    def decode_response(self, ids: list[int]) -> str:
        """The content of an assistant turn whose response ids (EOS dropped) are `ids`: the inverse
        of response(). The prefix's trailing spaces are encoded with the response, so they are
        decoded with the prefix, not kept as the content's first character (which response() would
        encode again, as another token)."""
        if not self.fmt.prefix_spaces_in_response:
            return self.sp.decode(ids)
        prefix = self.prefixes["assistant"]
        whole = self.sp.decode(self.head + list(ids))
        return whole[len(prefix):] if whole.startswith(prefix) else self.sp.decode(ids).lstrip(" ")
