"""Sample text from a training checkpoint in one process (CPU or one GPU).

    python -m tools.generate --checkpoint RUN_DIR[/checkpoints/TAG] --prompt "def main(" \\
        [--max-new-tokens 64 --temperature 0.8 --top-p 0.95 --greedy --seed 0]

The checkpoint is consolidated (any TP / DP / ZeRO layout, see pretrain.consolidate) into a model
at tensor-parallel size 1, on --device (default: the GPU when there is one). The prompt is encoded
with the run's SentencePiece tokenizer (data.tokenizer in RUN_DIR/config.yaml, or --tokenizer)
exactly as the training shards were, and begins with BOS when the run trained with
data.start_with_bos. --prompt-ids "5,6,7" gives token ids directly (runs without a tokenizer; BOS
is then yours to give). Sampling only draws real tokens (ids < model.vocab_size; the padding rows
of the embedding are never sampled) and stops at EOS (the tokenizer's, else the one an imported
model's config names) or after --max-new-tokens. The context is cut to the last model.max_seq_len
tokens (RoPE tables end there; a prompt longer than that is noted, and BOS stays first where the
run's samples began with it). Prints the continuation; --json prints ids too.

    python -m tools.generate --checkpoint SFT_RUN --chat "How do I sort a list?" [--system TEXT]

--chat answers a user message as a post-trained checkpoint (SFT, DPO) learned to: the message
(after --system's) rendered in the chat format the run trained with (its checkpoint records it,
BOS included), the assistant's response generated up to EOS and printed alone.
"""

from __future__ import annotations

import json
import sys

import torch

from data_prep.tokenizer import SPECIAL_IDS, continuation_text, load_tokenizer
from models.generation import generate
from posttrain.chat import ChatEncoder, ChatFormat
from pretrain.checkpoint_format import read_meta, resolve_checkpoint
from pretrain.consolidate import load_model, run_config
from pretrain.data import run_bos
from tools.cli import ToolError, argument_parser, reports_errors, run, tool_device
from tools.export import find_tokenizer


@reports_errors(ValueError)
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", required=True)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids to continue")
    prompt.add_argument("--chat", help="a user message to answer in the post-trained run's chat format")
    parser.add_argument("--system", default=None, help="with --chat: a system message before it")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (ignores temperature / top-p)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="SentencePiece tokenizer dir (default: the run's)")
    parser.add_argument("--json", action="store_true", help="print a JSON object with ids and text")
    parser.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda, cuda:1, ...")
    args = parser.parse_args(argv)
    if not 0.0 < args.top_p <= 1.0 or args.max_new_tokens < 0 or args.temperature < 0:
        raise ToolError("--top-p must be in (0, 1], --max-new-tokens >= 0 and --temperature >= 0 (0 = greedy)")
    given_ids = None
    if args.prompt_ids is not None:
        try:
            given_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise ToolError(f"--prompt-ids {args.prompt_ids!r}: give comma-separated token ids such as "
                            "5,6,7") from None
    if args.chat is not None and not args.chat.strip():
        raise ToolError("--chat is empty: give the user's message")
    if args.system is not None and args.chat is None:
        raise ToolError("--system goes with --chat (a conversation); with --prompt, write it into the text")
    device = tool_device(args.device)
    tag_dir = resolve_checkpoint(args.checkpoint)
    meta = read_meta(tag_dir)
    tokenizer_dir = find_tokenizer(tag_dir, args.tokenizer, meta, required=args.prompt_ids is None)
    sp = load_tokenizer(tokenizer_dir)[0] if tokenizer_dir is not None else None
    encoder = chat_encoder(tag_dir, meta, sp) if args.chat is not None else None
    if encoder is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt_ids = encoder.prompt([*system, {"role": "user", "content": args.chat}])
    elif args.prompt is not None:
        if sp is None:
            raise ToolError("this run has no SentencePiece tokenizer (data.tokenizer); pass --tokenizer DIR "
                            "or give --prompt-ids")
        prompt_ids = sp.encode(args.prompt)
    else:
        prompt_ids = given_ids
    bos = encoder.bos if encoder is not None else run_bos(run_config(tag_dir), meta)  # as the run's samples begin
    if bos is not None and args.prompt is not None and prompt_ids[:1] != [bos]:
        prompt_ids = [bos] + prompt_ids
    model, cfg, _ = load_model(tag_dir)
    model.to(device)
    bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ToolError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
    if len(prompt_ids) > cfg.max_seq_len:
        print(f"note: the prompt has {len(prompt_ids)} tokens, more than the model's {cfg.max_seq_len} positions "
              "(model.max_seq_len): only its last ones condition the continuation", file=sys.stderr)
    # Without a tokenizer: an imported model's own EOS, else the one the run's shards recorded
    recorded = meta.get("special_ids", {}).get("eos", meta.get("eos_id"))
    eos = sp.eos_id() if sp is not None else recorded if recorded is not None else SPECIAL_IDS["eos_id"]
    new = generate(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_p, args.greedy, eos,
                   torch.Generator().manual_seed(args.seed), bos=bos)
    if encoder is not None:
        text = encoder.decode_response(new[:-1] if new and new[-1] == eos else new)
    else:
        text = continuation_text(sp, prompt_ids, new) if sp is not None else None
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "ids": new, "text": text}))
    else:
        print(text if text is not None else " ".join(map(str, new)))
    return 0


def chat_encoder(tag_dir, meta: dict, sp) -> ChatEncoder:
    """The chat format a post-trained checkpoint was trained with."""
    trained = meta.get("posttrain", {})
    if "chat" not in trained:
        raise ToolError(f"--chat: {tag_dir} was not post-trained (it records no chat format): give "
                        "--prompt with the text to continue")
    if "value_head" in trained:
        raise ToolError("--chat: an SGA checkpoint answers with the scores it predicts written into the prompt: "
                        "python -m tools.sga_generate")
    return ChatEncoder(sp, ChatFormat.recorded(trained["chat"]))


if __name__ == "__main__":
    run(main)
