"""Framework training step vs a plain PyTorch loop on the same dense model, batch and weights.

    python -m bench.throughput [--steps 20 --trials 3 --zero-stage 1 --hidden 256 --layers 4]

Single process (DP=1, TP=1), fp32 in both. Trials alternate between the two loops so machine noise hits both;
the result is the ratio of tokens/s. Prints a table and writes bench/results/throughput.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.provenance import provenance
from models.config import ModelConfig
from models.gpt import GPT
from pretrain.config import Config
from pretrain.distributed import destroy_distributed, init_single_process
from pretrain.engine import build_engine, param_groups


def sync() -> None:
    if torch.cuda.is_available():  # the GPU's queued work, not the host's launches, is what is timed
        torch.cuda.synchronize()


def timed(step_fn, batches: list[torch.Tensor], warmup: int = 2) -> float:
    for batch in batches[:warmup]:
        step_fn(batch)
    sync()
    start = time.perf_counter()
    for batch in batches[warmup:]:
        step_fn(batch)
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="bench/results/throughput.json")
    args = parser.parse_args()
    if args.hidden < 64 or args.hidden % 64:
        parser.error(f"--hidden {args.hidden}: give a multiple of 64 (heads of 64)")

    init_single_process()
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=4096, hidden_size=args.hidden, num_layers=args.layers,
                            num_heads=args.hidden // 64, ffn_hidden_size=args.hidden * 8 // 3 // 64 * 64,
                            max_seq_len=args.seq)
    cfg.parallel.zero_stage = args.zero_stage
    cfg.train.micro_batch, cfg.train.steps, cfg.train.warmup_steps = args.batch, 10**6, 10
    cfg.train.precision = "fp32"  # as the plain loop runs (auto would be bf16 on a GPU)

    torch.manual_seed(0)
    model = GPT(cfg.model)
    plain_model = GPT(cfg.model)  # megatron layers hold process groups, which deepcopy cannot copy
    plain_model.load_state_dict(model.state_dict())
    engine = build_engine(cfg, model)
    plain_model.to(engine.device)  # both loops on the engine's device
    t = cfg.train
    optimizer = torch.optim.AdamW(param_groups(plain_model), lr=t.lr, betas=(t.beta1, t.beta2),
                                  weight_decay=t.weight_decay)

    def framework_step(batch):
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()

    def plain_step(batch):
        loss = plain_model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq + 1), generator=gen)
               for _ in range(args.steps + 2)]
    batches = [batch.to(engine.device) for batch in batches]
    tokens = args.steps * args.batch * args.seq
    plain_tps, framework_tps = [], []
    loops = [(plain_step, plain_tps), (framework_step, framework_tps)]
    for trial in range(args.trials):  # which loop goes first alternates: a slow start falls on both
        for step, tps in loops[::-1] if trial % 2 else loops:
            tps.append(tokens / timed(step, batches))
    ratios = [f / p for f, p in zip(framework_tps, plain_tps)]
    result = {
        "model": {"hidden": args.hidden, "layers": args.layers, "seq": args.seq, "batch": args.batch},
        "zero_stage": args.zero_stage, "device": str(engine.device), "precision": cfg.train.precision,
        "threads": torch.get_num_threads(), "provenance": provenance("bench.throughput"),
        "plain_tokens_per_s": plain_tps, "framework_tokens_per_s": framework_tps,
        "ratio_median": statistics.median(ratios), "ratios": ratios,
    }
    print(f"{'loop':<12}{'tokens/s (median)':>20}{'step time (ms)':>18}")
    for name, tps in (("plain", plain_tps), ("framework", framework_tps)):
        median = statistics.median(tps)
        print(f"{name:<12}{median:>20.0f}{1000 * args.batch * args.seq / median:>18.1f}")
    print(f"framework / plain tokens/s: {result['ratio_median']:.3f} (trials: {', '.join(f'{r:.3f}' for r in ratios)})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    destroy_distributed()


if __name__ == "__main__":
    main()
