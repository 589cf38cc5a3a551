"""A model trained here, converted to LISA at several sharing fractions, against its source: decode
speed with the KV cache, prefill, training step time, held-out perplexity and Q/K parameters.

    python -m bench.lisa_decode [--checkpoint RUN] [--fractions 0.25 0.5 0.75] [--steps 200]
    python -m bench.lisa_decode --source-overrides model.num_kv_heads=1 --align-hidden 0 \
        --runs runs/bench_lisa_decode_gqa --out bench/results/lisa_decode_gqa.json   # LISA on score features
    python -m bench.lisa_decode --speed-only bench/results/lisa_decode.json --device cuda \
        --speed-hidden 2048 --out lisa_decode_gpu.json    # the speed part alone, on a GPU in bf16

Without --checkpoint it first trains configs/tiny_dense.yaml at 8 layers (--train-steps, seed 0).
Each fraction runs tools.convert_lisa with --layers sensitivity (the least sensitive layers, the
first one kept; no loss budget), the head permutation matched within alignment groups, the
default --qk-init, and --steps steps of training the new parameters. Measured on this device, one
process: the held-out loss (shards' val split) after that training; decoding `--new` tokens after a
`--prompt`-token prompt, batch 1, through the Hugging Face modeling file with the KV cache (the
exported model, built in memory; decode steps only) and through the framework's generate (greedy,
the whole call: with its KV cache, and recomputing the context for every token); the HF prefill
time; one forward + backward of a training micro-batch. Times are medians of --repeats.

At this size a decode step is mostly per-operator overhead, so the same layouts are timed again at
--speed-hidden (default 1024: 8 layers, head_dim 128, LISA rank 16 in alignment groups of 4, as in
configs/hybrid_1b.yaml; random weights, since speed does not depend on them): `--speed-new` cached
decode steps after prefills of each of --speed-contexts positions, through the framework's KV cache
(what generate runs) and the HF modeling file's, the framework's also for several sequences at once
(--speed-batches: where the cached keys and values, not the weights, are most of what a step
reads), the bytes its cache holds per position, and one training step at --speed-train-seq. At
equal cache memory (the paper's "max throughput"), every model decodes as many sequences as fit
in the bytes the source's cache takes at --equal-memory-batch sequences, after each of
--equal-memory-contexts positions, and tokens/s counts them all. The
models take turns within every repeat and each ratio to the source is taken per repeat (median and
range reported), so the machine's drift hits all of them alike. Writes bench/results/lisa_decode.json.

The speed part runs on --device (cuda in --dtype, default bf16, where a GPU is present) with
--speed-only RESULTS: the layouts an earlier run chose (its rows' attention kinds, on
configs/tiny_dense.yaml with its --source-overrides and --align-hidden), no training or
conversion, so a GPU session measures them in a few minutes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from bench.provenance import provenance
from bench.trainer_runs import REPO, RunSettings, run_variant

SOURCE_CONFIG, SOURCE_LAYERS = "configs/tiny_dense.yaml", ["model.num_layers=8"]  # the source trained here


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf_model(model, cfg):
    """The model as tools.export writes it (the bundled modeling file), in memory."""
    from tools.export import _remote_module, remote_config, to_remote_state

    config = remote_config(cfg, torch.float32, {"bos": 1, "eos": 2, "pad": 3})
    hf = _remote_module().UoEPretrainForCausalLM(config)
    hf.load_state_dict(to_remote_state(cfg, model.state_dict()), strict=not cfg.tie_embeddings)
    return hf.eval()


@torch.no_grad()
def decode_times(model, cfg, prompt: torch.Tensor, new: int, repeats: int) -> dict:
    from models.generation import generate

    hf = hf_model(model, cfg)

    def cached() -> float:
        """Seconds of the `new` cached steps after an untimed prefill."""
        out = hf(prompt, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new):
            out = hf(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0

    model.eval()
    ids = prompt[0].tolist()
    prefill = median_seconds(lambda: hf(prompt, use_cache=True), repeats)
    cached()  # warm-up
    decode = statistics.median(cached() for _ in range(repeats))
    return {"prefill_ms": 1000 * prefill, "decode_tokens_per_s": new / decode,
            "generate_tokens_per_s": new / median_seconds(lambda: generate(model, ids, new, greedy=True), repeats),
            "recompute_tokens_per_s": new / median_seconds(
                lambda: generate(model, ids, new, greedy=True, use_cache=False), repeats)}


def train_step_ms(model, batch: torch.Tensor, repeats: int) -> float:
    model.train()
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)

    def step():
        model(batch[:, :-1], batch[:, 1:]).backward()
        for p in params:
            p.grad = None

    return 1000 * median_seconds(step, repeats)


HEAD_DIM = 128  # the 1B hybrid config's


def check_wide_hidden(parser: argparse.ArgumentParser, flag: str, hidden: int, allow_zero: bool = False) -> None:
    """A width wide_config can build: whole heads of HEAD_DIM."""
    if hidden % HEAD_DIM or hidden < (0 if allow_zero else HEAD_DIM):
        parser.error(f"{flag} {hidden}: the timed layouts use heads of {HEAD_DIM} dims, so give a positive multiple "
                     f"of {HEAD_DIM}" + (" (0: skip)" if allow_zero else ""))


def wide_config(cfg, hidden: int, max_seq_len: int):
    """cfg's layers (kinds, K/V sharing, LISA alignment width) at `hidden` wide, with the 1B hybrid
    config's head width, rank and alignment group (head_dim 128, rank 16, groups of 4 heads)."""
    from models.config import ModelConfig

    values = cfg.to_dict()
    heads = hidden // HEAD_DIM
    ffn = round(cfg.ffn_hidden_size * hidden / cfg.hidden_size)
    values.update(hidden_size=hidden, num_heads=heads, ffn_hidden_size=ffn,
                  # grouped-query sharing kept, at least one K/V head (0 would mean one per query head)
                  num_kv_heads=max(1, cfg.kv_heads * heads // cfg.num_heads) if cfg.num_kv_heads else 0,
                  max_seq_len=max_seq_len)
    values["lisa"].update(rank=16, align_group=min(4, heads))
    return ModelConfig.from_dict(values)


def synchronized(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def cached_decode(model, hf, context: int, new: int, vocab: int, batch: int) -> tuple[dict, int]:
    """Timers (seconds of `new` greedy cached steps of `batch` sequences) after one untimed prefill of
    `context` random tokens each, which every call reuses: the framework's KV cache, and at batch 1
    also the HF modeling file's; and the bytes the framework's cache holds per sequence and position."""
    from models.attention.kv_cache import KVCache

    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    cache = KVCache(context + new)  # sized as generate sizes it
    first = model.logits(prompt, {"kv_cache": cache})[:, -1:, :vocab].argmax(-1)

    @torch.no_grad()
    def framework() -> float:
        held, token = cache.copy(), first
        synchronized(device)
        t0 = time.perf_counter()
        for _ in range(new):
            token = model.logits(token, {"kv_cache": held})[:, -1:, :vocab].argmax(-1)
        synchronized(device)
        return time.perf_counter() - t0

    per_position = cache.nbytes() // (batch * context)
    if batch > 1:
        return {f"framework_decode_b{batch}@{context}": framework}, per_position
    out = hf(prompt, use_cache=True)
    hf_cache, hf_first = out.past_key_values, out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def hf_decode() -> float:
        held, token = copy.deepcopy(hf_cache), hf_first
        synchronized(device)
        t0 = time.perf_counter()
        for _ in range(new):
            out = hf(token, past_key_values=held, use_cache=True)
            held, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        synchronized(device)
        return time.perf_counter() - t0

    return {f"framework_decode@{context}": framework, f"hf_decode@{context}": hf_decode}, per_position


def speed_table(layouts: list[tuple[str, object]], args) -> dict:
    """Decode and training-step times of every layout at --speed-hidden (random weights: speed does
    not depend on them). For each batch and context the models are prefilled, then timed in turn
    within every repeat, so drift of the machine hits all of them (and only one context's caches
    are held at a time); each model's ratio to the source is taken per repeat, and its median and
    range reported."""
    from models.gpt import GPT

    device, dtype = speed_device(args)
    models, out = {}, {}
    for name, cfg in layouts:
        longest = max([*args.speed_contexts, *args.equal_memory_contexts]) + args.speed_new
        wide = wide_config(cfg, args.speed_hidden, max(longest, args.speed_train_seq))
        torch.manual_seed(0)
        model = GPT(wide).eval()
        hf = hf_model(model, wide).to(device, dtype)
        models[name] = (model.to(device, dtype), hf, wide)
        out[name] = {"attention": wide.attention, "keep_chain_scores": wide.lisa.keep_chain_scores,
                     "params": sum(p.numel() for p in model.parameters())}
        print(f"speed: built {name} ({out[name]['params'] / 1e6:.1f}M parameters)", flush=True)
    samples = {name: {} for name in models}

    def in_turn(timers: dict) -> None:
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, fns in timers.items():
                for key, fn in fns.items():
                    seconds = fn()
                    if repeat:
                        samples[name].setdefault(key, []).append(seconds)

    for batch in args.speed_batches:
        for context in args.speed_contexts:
            timers = {}
            for name, (model, hf, wide) in models.items():
                timers[name], out[name]["cache_bytes_per_position"] = cached_decode(
                    model, hf, context, args.speed_new, wide.vocab_size, batch)
            in_turn(timers)
            print(f"speed: decode of {batch} x {context} positions timed", flush=True)

    # Equal cache memory: each model decodes as many sequences as its cache fits into the source's
    # at --equal-memory-batch (tokens/s then counts every sequence).
    source_bytes = out[layouts[0][0]]["cache_bytes_per_position"]
    sequences = {}
    for context in args.equal_memory_contexts:
        timers, key = {}, f"equal_memory_decode@{context}"
        for name, (model, hf, wide) in models.items():
            batch = int(args.equal_memory_batch * source_bytes / out[name]["cache_bytes_per_position"])
            sequences.setdefault(name, {})[key] = out[name].setdefault("equal_memory_batch", {})[context] = batch
            fns, _ = cached_decode(model, hf, context, args.speed_new, wide.vocab_size, batch)
            timers[name] = {key: next(iter(fns.values()))}
        in_turn(timers)
        print(f"speed: decode at equal cache memory ({args.equal_memory_batch} source sequences x {context}) timed",
              flush=True)

    def train_step(model, vocab: int) -> float:
        from bench.lisa_train_step import step_seconds

        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (1, args.speed_train_seq + 1), generator=generator).to(device)
        model.train()
        try:
            return step_seconds(model, tokens)
        finally:
            model.eval()

    in_turn({name: {"train_step": partial(train_step, model, wide.vocab_size)}
             for name, (model, _, wide) in models.items()})
    source = samples[layouts[0][0]]
    for name, times in samples.items():
        for key, seconds in times.items():
            # Decode: tokens/s x source = source time / this time; training step: this time / source's.
            tokens = sequences.get(name, {}).get(key, 1) / sequences.get(layouts[0][0], {}).get(key, 1)
            ratios = [(t / s if key == "train_step" else tokens * s / t) for s, t in zip(source[key], seconds)]
            out[name][key] = {"median_s": statistics.median(seconds), "x_source": statistics.median(ratios),
                              "x_source_range": [min(ratios), max(ratios)]}
    keys = list(samples[layouts[0][0]])
    print(f"\nspeed at hidden {args.speed_hidden} (x source: decode tokens/s, train step time; median [range])")
    print(f"{'':<28}" + "".join(f"{name:>20}" for name in out))
    for key in keys:
        cells = [(row[key]["x_source"], *row[key]["x_source_range"]) for row in out.values()]
        print(f"{key:<28}" + "".join(f"{x:>8.2f} [{low:.2f}-{high:.2f}]" for x, low, high in cells))
    print(f"{'KV cache x source':<28}" + "".join(f"{row['cache_bytes_per_position'] / source_bytes:>20.2f}"
                                                  for row in out.values()))
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": str(dtype)[6:], "hidden": args.speed_hidden, "contexts": args.speed_contexts,
            "batches": args.speed_batches,
            "new": args.speed_new, "equal_memory_batch": args.equal_memory_batch,
            "equal_memory_contexts": args.equal_memory_contexts,
            "train_seq": args.speed_train_seq, "repeats": args.repeats, "models": out}


def speed_device(args) -> tuple[torch.device, torch.dtype]:
    """Where the speed part runs and in what: --device, --dtype (bf16 on a GPU, else fp32)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU here (choose --device cpu)")
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    return device, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


def layouts_of(results: Path) -> list[tuple[str, object]]:
    """The source and converted layouts of an earlier run's results file: its rows' attention kinds on
    the source's config (SOURCE_CONFIG, SOURCE_LAYERS) with that run's --source-overrides and
    --align-hidden, the first layer kept full as the conversion keeps it."""
    from models.attention.lisa import chained_lisa_layers
    from pretrain.config import load_config

    saved = json.loads(results.read_text())
    meta, rows = saved["meta"], saved.get("rows") or []
    if not rows:
        raise SystemExit(f"{results} holds no rows (layouts) of a conversion run; run bench.lisa_decode "
                         "without --speed-only first")
    source = load_config(str(REPO / SOURCE_CONFIG), [*SOURCE_LAYERS, *meta["source_overrides"]]).model
    layouts = []
    for row in rows:
        cfg = copy.deepcopy(source)
        cfg.attention, cfg.lisa.keep_full_layers = row["attention"], 1
        if meta.get("align_hidden") is not None:
            cfg.lisa.align_hidden = meta["align_hidden"]
        # as the conversion set it (rows from before it was recorded: where LISA layers form chains)
        chains = bool(chained_lisa_layers(cfg.attention_kinds()))
        cfg.lisa.keep_chain_scores = row.get("keep_chain_scores", chains)
        layouts.append((row["model"], cfg))
    return layouts


def qk_params(model, cfg) -> int:
    """Q/K parameters of every attention layer: Q and grouped K of full layers, the low-rank Q/K of
    LISA layers."""
    full = cfg.hidden_size * (cfg.hidden_size + cfg.kv_width)
    return sum(block.attn.qk.weight.numel() if hasattr(block.attn, "qk") else full for block in model.blocks)


def measure(name: str, model, cfg, val_loss: float, prompt, batch, args) -> dict:
    row = {"model": name, "attention": cfg.attention, "keep_chain_scores": cfg.lisa.keep_chain_scores,
           "val_loss": val_loss, "perplexity": math.exp(val_loss),
           "qk_params": qk_params(model, cfg), **decode_times(model, cfg, prompt, args.new, args.repeats),
           "train_step_ms": train_step_ms(model, batch, args.repeats)}
    print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'model'})}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a trained run (default: train one)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--steps", type=int, default=200, help="conversion training steps")
    parser.add_argument("--train-steps", type=int, default=300, help="steps of the source model trained here")
    parser.add_argument("--shards", default="data/demo/shards")
    parser.add_argument("--tokenizer", default="data/demo/tokenizer")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=63)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", default="runs/bench_lisa_decode")
    parser.add_argument("--source-overrides", nargs="*", default=[],
                        help="config overrides of the trained source, e.g. model.num_kv_heads=1")
    parser.add_argument("--align-hidden", type=int, default=None,
                        help="convert_lisa --align-hidden (0: linear alignment, attended as score features)")
    parser.add_argument("--reuse", action="store_true",
                        help="time the source and conversions of an earlier run in --runs again (no training)")
    parser.add_argument("--speed-hidden", type=int, default=1024,
                        help="also time every layout at this width with random weights (0: skip)")
    parser.add_argument("--speed-contexts", type=int, nargs="+", default=[128, 1024, 4096],
                        help="prefilled positions before the timed decode steps")
    parser.add_argument("--speed-batches", type=int, nargs="+", default=[1, 8],
                        help="sequences decoded together (the HF path at batch 1 only)")
    parser.add_argument("--equal-memory-batch", type=int, default=16,
                        help="sequences of the source at equal cache memory (each LISA model decodes as many as "
                             "fit in the same bytes)")
    parser.add_argument("--equal-memory-contexts", type=int, nargs="*", default=[1024, 2048],
                        help="prefilled positions of the equal-memory decode (none: skip it)")
    parser.add_argument("--speed-new", type=int, default=16, help="decode steps timed per context")
    parser.add_argument("--speed-train-seq", type=int, default=512, help="sequence of the timed training step")
    parser.add_argument("--out", default="bench/results/lisa_decode.json")
    parser.add_argument("--speed-only", metavar="RESULTS", type=Path,
                        help="only the speed part, of the layouts in an earlier run's results file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the speed part runs (default: cuda where a GPU is present)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"],
                        help="the speed part's (default bf16 on cuda, else fp32)")
    args = parser.parse_args()
    check_wide_hidden(parser, "--speed-hidden", args.speed_hidden, allow_zero=True)
    speed_device(args)  # a --device that is not here fails now, not after the conversions
    if args.speed_only:
        from pretrain.distributed import init_single_process

        init_single_process()  # the models' layers read megatron-core's (single-process) groups
        speed = speed_table(layouts_of(args.speed_only), args)
        meta = {"layouts_from": str(args.speed_only), "threads": torch.get_num_threads(),
                **provenance("bench.lisa_decode")}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": None, "speed": speed}, indent=1))
        print(f"wrote {args.out}")
        return
    from pretrain.consolidate import load_model
    from pretrain.data import read_samples
    from tools.convert_lisa import main as convert

    runs = REPO / args.runs
    source_run = args.checkpoint
    if source_run is None and args.reuse:
        source_run = runs / "source"
    elif source_run is None:
        source_run = runs / "source"
        print(f"training the source model ({args.train_steps} steps) ...", flush=True)
        settings = RunSettings(steps=args.train_steps, nproc=1, micro_batch=16, eval_batches=8,
                               shards=args.shards, tokenizer=args.tokenizer, device="cpu", evals=1)
        run_variant("lisa-source", SOURCE_CONFIG, [*SOURCE_LAYERS, *args.source_overrides], settings,
                    0, source_run)
    from pretrain.checkpoint_format import CheckpointError

    try:
        source, cfg, _ = load_model(str(source_run))
    except CheckpointError as err:
        raise SystemExit(f"--checkpoint: {err}") from None
    samples = read_samples(Path(args.shards) / "val", 9)
    prompt, batch = samples[:1, :args.prompt], samples[1:9]
    if args.prompt + args.new > cfg.max_seq_len:
        raise SystemExit(f"--prompt {args.prompt} + --new {args.new} exceeds max_seq_len {cfg.max_seq_len}")
    rows, layouts, source_loss = [], [], None
    for fraction in args.fractions:
        out = runs / f"lisa_{int(100 * fraction)}"
        if not (args.reuse and (out / "conversion.json").is_file() and (out / "converted").is_dir()):
            convert(["--checkpoint", str(source_run), "--layers", "sensitivity", "--loss-budget", "1e9",
                     "--max-fraction", str(fraction), "--keep-full-layers", "1", "--calib-shards", args.shards,
                     "--out", str(out), "--overwrite", "--steps", str(args.steps), "--micro-batch", "8",
                     "--val-samples", "64",
                     *(["--align-hidden", str(args.align_hidden)] if args.align_hidden is not None else [])])
        report = json.loads((out / "conversion.json").read_text())
        model, new_cfg, _ = load_model(out / "converted")
        if source_loss is None:
            source_loss = report["val_loss"]["source"]
            rows.append(measure("source", source, cfg, source_loss, prompt, batch, args))
            layouts.append(("source", cfg))
        layouts.append((f"lisa {100 * fraction:.0f}%", new_cfg))
        row = measure(f"lisa {100 * fraction:.0f}%", model, new_cfg, report["val_loss"]["converted_trained"],
                      prompt, batch, args)
        row.update(layers=report["layers"], shared_fraction=len(report["layers"]) / cfg.num_layers,
                   val_loss_before_training=report["val_loss"]["converted_init"], qk_init=report["qk_init"])
        rows.append(row)
    base = rows[0]
    print(f"{'model':<10}{'layers shared':>15}{'ppl':>8}{'x src':>7}{'decode tok/s':>14}{'x src':>7}"
          f"{'generate tok/s':>16}{'x src':>7}{'prefill ms':>12}{'train ms':>10}{'x src':>7}{'Q/K params':>12}")
    for r in rows:
        r["perplexity_x_source"] = r["perplexity"] / base["perplexity"]
        r["decode_x_source"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        r["generate_x_source"] = r["generate_tokens_per_s"] / base["generate_tokens_per_s"]
        r["recompute_x_source"] = r["recompute_tokens_per_s"] / base["recompute_tokens_per_s"]
        r["train_step_x_source"] = r["train_step_ms"] / base["train_step_ms"]
        shared = ",".join(map(str, r.get("layers", []))) or "-"
        print(f"{r['model']:<10}{shared:>15}{r['perplexity']:>8.2f}{r['perplexity_x_source']:>7.3f}"
              f"{r['decode_tokens_per_s']:>14.1f}{r['decode_x_source']:>7.2f}{r['generate_tokens_per_s']:>16.1f}"
              f"{r['generate_x_source']:>7.2f}{r['prefill_ms']:>12.1f}{r['train_step_ms']:>10.1f}"
              f"{r['train_step_x_source']:>7.2f}{r['qk_params']:>12,}")
    meta = {"source": str(source_run), "source_overrides": args.source_overrides, "align_hidden": args.align_hidden,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads(), **provenance("bench.lisa_decode", shards=args.shards),
            "steps": args.steps,
            "prompt": args.prompt, "new": args.new,
            "repeats": args.repeats, "batch_for_train_step": list(batch.shape),
            "note": "times are medians of --repeats in one process; other work on the machine moves them"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "speed": None}, indent=1))  # kept if the speed part fails
    if args.speed_hidden:
        out.write_text(json.dumps({"meta": meta, "rows": rows, "speed": speed_table(layouts, args)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
