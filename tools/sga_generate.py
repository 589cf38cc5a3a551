"""Self-Guided Alignment inference in two stages, on a checkpoint trained with post.method=sga.

    python -m tools.sga_generate --checkpoint RUN_DIR[/checkpoints/TAG] --prompt "Write a haiku" \\
        [--scores helpfulness=0.9,verbosity=0.2] [--max-new-tokens 128 --temperature 0.6 --top-p 0.9 --seed 0]

Stage 1 predicts one score in [0, 1] per objective from the raw prompt with the value head and
prints them; a prediction for an objective trained on a scale (HelpSteer2's 0, .25, ..., 1) is
snapped to its nearest level (--no-snap: as predicted); stage 2 appends them to the prompt as text
(the run's post.score_* format) and generates. --scores replaces the prediction (all objectives,
or some: the rest stay predicted).
--json prints both stages as one JSON object.
"""

from __future__ import annotations

import json

import torch

from posttrain.inference import SGAModel
from pretrain.checkpoint_format import read_meta, resolve_checkpoint
from tools.cli import ToolError, argument_parser, reports_errors, run
from tools.export import run_tokenizer


def parse_scores(text: str) -> dict[str, float]:
    scores = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            scores[name.strip()] = float(value)
        except ValueError:
            raise ToolError(f"--scores {text!r}: give name=value pairs, e.g. helpfulness=0.9,verbosity=0.2") from None
        if not 0 <= scores[name.strip()] <= 1:
            raise ToolError(f"--scores: {name.strip()}={value} is outside [0, 1]")
    return scores


@reports_errors(ValueError)
def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompt", required=True, help="the user's message")
    parser.add_argument("--system", default=None, help="a system message before it")
    parser.add_argument("--scores", default="", help="name=value,... instead of the predicted scores")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="SentencePiece tokenizer dir (default: the run's)")
    parser.add_argument("--no-snap", action="store_true",
                        help="condition on the predicted scores as they are, not snapped to the trained scale")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0.0 < args.top_p <= 1.0 or args.max_new_tokens < 0:
        raise ToolError("--top-p must be in (0, 1] and --max-new-tokens >= 0")
    given = parse_scores(args.scores)
    tag_dir = resolve_checkpoint(args.checkpoint)
    sp = run_tokenizer(tag_dir, args.tokenizer, read_meta(tag_dir))
    sga = SGAModel.load(tag_dir, sp)
    unknown = sorted(set(given) - set(sga.objectives))
    if unknown:
        raise ToolError(f"--scores names {unknown}, but the model's objectives are {sga.objectives}")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    predicted = sga.predict(messages)
    scores = {**(predicted if args.no_snap else sga.snap(predicted)), **given}
    if not args.json:
        print("predicted scores: " + ", ".join(f"{k} {v:.3f}" for k, v in predicted.items()), flush=True)
        if scores != predicted:
            print("used scores: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True)
    ids = sga.generate(messages, scores, args.max_new_tokens, args.temperature, args.top_p, args.greedy,
                       torch.Generator().manual_seed(args.seed))
    text = sga.encoder.decode_response(ids)
    if args.json:
        print(json.dumps({"predicted_scores": predicted, "scores": scores,
                          "conditioning": sga.scores_format.text(scores), "ids": ids, "text": text}))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    run(main)
