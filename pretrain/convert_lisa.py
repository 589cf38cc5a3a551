"""Convert a trained checkpoint to a LISA model: share attention scores in redundant layers.

    python -m pretrain.convert_lisa --checkpoint RUN/checkpoints/step_X --layers auto|3,4,5 \\
        --calib-shards DIR --out RUN_DIR [--steps N]

1. Loads the checkpoint into one process (any saved layout, see pretrain.consolidate).
2. On calibration batches (DIR/train) measures, for each layer l, how similar its attention maps
   are to layer l-1's after matching heads (greedy one-to-one matching on the per-head cosine
   similarity of the maps, averaged over the batch).
3. Proposes layers (auto: similarity >= --threshold, most similar first, at most --max-fraction
   of the layers, never the first model.lisa.keep_full_layers), or takes the given list.
4. Builds the LISA model: every weight copied; a LISA layer keeps V (from the fused QKV) and the
   output projection, starts its head-alignment FFN as the matched head permutation (identity if
   model.lisa.align_group is smaller than num_heads) and its low-rank Q/K correction at zero.
5. Freezes everything but the new LISA parameters (alignment FFNs, low-rank Q/K), trains them
   --steps steps on DIR/train with the LM loss, and prints validation loss (DIR/val) of the
   original, the converted model before training and after, parameter counts, Q/K compression
   and the forward throughput change.

Writes RUN_DIR/lisa_model.pt ({"model": ModelConfig dict, "state_dict": ...}),
RUN_DIR/config.yaml (the source run's config with the new attention pattern and
train.init_from=RUN_DIR/lisa_model.pt, so `python -m pretrain.train --config RUN_DIR/config.yaml`
continues training the converted model at any layout) and RUN_DIR/conversion.json. Single
process, CPU or one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from models.sinks import capture_attention


def read_samples(shards: str | Path, split: str, count: int) -> torch.Tensor:
    """The first `count` token rows [count, seq + 1] of shards/split (repeated if fewer)."""
    from streaming import StreamingDataset

    from pretrain.data import clean_shared_memory_once

    clean_shared_memory_once()
    dataset = StreamingDataset(local=str(Path(shards) / split), shuffle=False, batch_size=1)
    rows = [torch.from_numpy(dataset[i % len(dataset)]["tokens"].astype("int64")) for i in range(count)]
    return torch.stack(rows)


def head_similarity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[H_a, H_b] cosine similarity of attention maps a, b [batch, heads, q, k], batch-averaged."""
    fa = torch.nn.functional.normalize(a.float().flatten(2), dim=-1)  # [batch, H, q*k]
    fb = torch.nn.functional.normalize(b.float().flatten(2), dim=-1)
    return torch.einsum("bhn,bgn->bhg", fa, fb).mean(0)


def greedy_match(sim: torch.Tensor) -> list[int]:
    """match[h_new] = h_prev, one to one, taking the most similar remaining pair first."""
    sim = sim.clone()
    match = [-1] * sim.shape[1]
    for _ in range(sim.shape[0]):
        flat = int(torch.argmax(sim))
        prev, new = divmod(flat, sim.shape[1])
        match[new] = prev
        sim[prev, :] = -float("inf")
        sim[:, new] = -float("inf")
    return match


@torch.no_grad()
def layer_similarity(model, batches: list[torch.Tensor]) -> dict[int, dict]:
    """For l >= 1: {"similarity": matched mean cosine, "unmatched": same-index mean cosine, "match": [...]}."""
    sims: dict[int, torch.Tensor] = {}
    for tokens in batches:
        maps = capture_attention(model, tokens)
        for layer in range(1, len(maps)):
            s = head_similarity(maps[layer - 1], maps[layer])
            sims[layer] = sims.get(layer, 0) + s / len(batches)
    out = {}
    for layer, s in sims.items():
        match = greedy_match(s)
        out[layer] = {"similarity": float(torch.stack([s[p, n] for n, p in enumerate(match)]).mean()),
                      "unmatched": float(s.diagonal().mean()), "match": match}
    return out


def family(kind: str) -> str:
    return "relu" if kind == "relu" else "softmax"


def conversion_problem(kinds: list[str], layers: list[int], keep_full: int) -> str | None:
    """Why turning `layers` into LISA layers would change what the model computes, or None.
    A LISA layer applies the attention function of the nearest earlier non-LISA layer, so a
    replaced layer (and every existing LISA layer) must keep its softmax / ReLU family."""
    from models.attention import lisa_source_kind

    new = list(kinds)
    for layer in layers:
        if layer < max(keep_full, 1):
            return f"layer {layer} is within model.lisa.keep_full_layers={keep_full}"
        if kinds[layer] == "lisa":
            return f"layer {layer} is already a LISA layer"
        new[layer] = "lisa"
    for layer, kind in enumerate(new):
        if kind != "lisa":
            continue
        before = kinds[layer] if kinds[layer] != "lisa" else lisa_source_kind(kinds, layer)
        if family(lisa_source_kind(new, layer)) != family(before):
            return (f"layer {layer} would share from a {lisa_source_kind(new, layer)} layer but computes "
                    f"{family(before)} attention")
    return None


def propose_layers(sim: dict[int, dict], kinds: list[str], keep_full: int, threshold: float,
                   max_fraction: float) -> list[int]:
    """Most similar layers first, each kept only if the set stays convertible."""
    ranked = sorted((l for l in sim if conversion_problem(kinds, [l], keep_full) is None),
                    key=lambda l: -sim[l]["similarity"])
    limit = max(1, int(max_fraction * len(kinds)))
    chosen: list[int] = []
    for layer in ranked:
        if len(chosen) < limit and sim[layer]["similarity"] >= threshold and \
                conversion_problem(kinds, chosen + [layer], keep_full) is None:
            chosen.append(layer)
    return sorted(chosen or ranked[:1])


def lisa_config(cfg, layers: list[int]):
    problem = conversion_problem(cfg.attention_kinds(), layers, cfg.lisa.keep_full_layers)
    if problem:
        raise ValueError(f"cannot convert layers {layers}: {problem}")
    new = dataclasses.replace(cfg, lisa=dataclasses.replace(cfg.lisa),
                              relu_attention=dataclasses.replace(cfg.relu_attention), moe=dataclasses.replace(cfg.moe))
    kinds = cfg.attention_kinds()
    for layer in layers:
        kinds[layer] = "lisa"
    new.attention = ",".join(kinds)
    new.attention_kinds()  # validates placement
    return new


@torch.no_grad()
def build_lisa_model(source, cfg, new_cfg, layers: list[int], sim: dict[int, dict]):
    from models.attention.lisa import LISAAttention
    from models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(new_cfg)
    own = model.state_dict()
    replaced = tuple(f"blocks.{i}.attn." for i in layers)
    for name, value in source.state_dict().items():
        if torch.is_tensor(value) and not name.startswith(replaced):
            own[name].copy_(value)  # everything outside the replaced attention layers, unchanged
    for i in layers:
        src_attn = source.blocks[i].attn
        lisa: LISAAttention = model.blocks[i].attn
        h, g, hd, d = cfg.num_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim, cfg.hidden_size
        if not hasattr(src_attn, "qkv"):
            raise ValueError(f"layer {i} is already a LISA layer; choose other layers")
        qkv = src_attn.qkv.weight.view(cfg.kv_heads, g + 2, hd, d)  # grouped by K/V head
        lisa.v.weight.copy_(qkv[:, g + 1].reshape(cfg.kv_width, d))
        lisa.out.weight.copy_(src_attn.out.weight)
        group = lisa.align.group
        if group == h and i in sim:  # the matched head permutation: new head n reads previous head match[n]
            mix = torch.zeros(h, h)
            for n, p in enumerate(sim[i]["match"]):
                mix[n, p] = 1.0
            lisa.align.mix.copy_(mix.unsqueeze(0))
    return model


def new_parameters(model, layers: list[int]) -> list[torch.nn.Parameter]:
    params = []
    for i in layers:
        attn = model.blocks[i].attn
        params += list(attn.qk.parameters()) + list(attn.align.parameters())
    return params


@torch.no_grad()
def val_loss(model, rows: torch.Tensor, micro: int) -> float:
    model.eval()
    losses = [float(model(b[:, :-1], b[:, 1:])) for b in rows.split(micro)]
    return sum(losses) / len(losses)


@torch.no_grad()
def forward_tokens_per_s(model, rows: torch.Tensor, repeats: int = 3) -> float:
    model.eval()
    tokens = rows[:, :-1]
    model.logits(tokens)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        model.logits(tokens)
    return repeats * tokens.numel() / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    from models.attention.lisa import qk_compression
    from pretrain.consolidate import load_model, run_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--layers", default="auto", help="auto or comma-separated layer indices")
    parser.add_argument("--calib-shards", required=True, help="shards directory with train/ (and val/)")
    parser.add_argument("--out", required=True, help="run directory for the converted model")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--calib-batches", type=int, default=4)
    parser.add_argument("--val-samples", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=0.6, help="auto: minimum matched map similarity")
    parser.add_argument("--max-fraction", type=float, default=0.75, help="auto: at most this share of layers")
    parser.add_argument("--align-group", type=int, default=None, help="override model.lisa.align_group")
    args = parser.parse_args(argv)

    source, cfg, meta = load_model(args.checkpoint)
    for p in source.parameters():
        p.requires_grad_(False)
    kinds = cfg.attention_kinds()
    calib = read_samples(args.calib_shards, "train", args.calib_batches * args.micro_batch)
    val_split = "val" if (Path(args.calib_shards) / "val").is_dir() else "train"
    val = read_samples(args.calib_shards, val_split, args.val_samples)

    sim = layer_similarity(source, [b[:, :-1] for b in calib.split(args.micro_batch)])
    print(f"{'layer':>5} {'kind':<13} {'sim to l-1 (matched)':>20} {'(same index)':>12}  head match")
    for layer in range(len(kinds)):
        s = sim.get(layer)
        print(f"{layer:>5} {kinds[layer]:<13} " + (f"{s['similarity']:>20.4f} {s['unmatched']:>12.4f}  {s['match']}"
                                                   if s else f"{'-':>20} {'-':>12}"))
    if args.align_group is not None:
        cfg.lisa.align_group = args.align_group
    if args.layers == "auto":
        layers = propose_layers(sim, kinds, cfg.lisa.keep_full_layers, args.threshold, args.max_fraction)
    else:
        layers = sorted(int(x) for x in args.layers.split(",") if x.strip())
    if not layers:
        print("error: no layer can become a LISA layer here (see conversion_problem: keep_full_layers, "
              "existing LISA layers, softmax / ReLU families)", file=sys.stderr)
        return 2
    try:
        new_cfg = lisa_config(cfg, layers)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"LISA layers: {layers}; attention {new_cfg.attention}")
    model = build_lisa_model(source, cfg, new_cfg, layers, sim)
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = new_parameters(model, layers)
    for p in trainable:
        p.requires_grad_(True)

    loss_source = val_loss(source, val, args.micro_batch)
    loss_init = val_loss(model, val, args.micro_batch)
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    model.train()
    train_rows = read_samples(args.calib_shards, "train", max(args.steps, 1) * args.micro_batch)
    t0 = time.perf_counter()
    for step, batch in enumerate(train_rows.split(args.micro_batch)[: args.steps]):
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"step {step + 1}/{args.steps} | train loss {loss.item():.4f}", flush=True)
    train_s = time.perf_counter() - t0
    loss_after = val_loss(model, val, args.micro_batch)

    n_source = sum(p.numel() for p in source.parameters())
    n_new = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in trainable)
    qk_source = sum(2 * cfg.hidden_size ** 2 for _ in layers)
    qk_new = sum(model.blocks[i].attn.qk.weight.numel() for i in layers)
    tps_source = forward_tokens_per_s(source, val[: args.micro_batch])
    tps_new = forward_tokens_per_s(model, val[: args.micro_batch])
    report = {
        "checkpoint": str(args.checkpoint), "layers": layers, "attention": new_cfg.attention,
        "similarity": {str(k): v for k, v in sim.items()},
        "val_loss": {"source": loss_source, "converted_init": loss_init, "converted_trained": loss_after},
        "steps": args.steps, "train_seconds": train_s,
        "params": {"source": n_source, "converted": n_new, "trained": n_train,
                   "trained_fraction": n_train / n_new},
        "qk_params": {"replaced_layers_source": qk_source, "replaced_layers_lisa": qk_new,
                      "compression": qk_source / max(qk_new, 1), "per_layer_compression": qk_compression(new_cfg)},
        "forward_tokens_per_s": {"source": tps_source, "converted": tps_new, "ratio": tps_new / tps_source},
    }
    print(f"val loss: source {loss_source:.4f} | converted, before training {loss_init:.4f} | "
          f"after {args.steps} steps {loss_after:.4f}")
    print(f"params: {n_source:,} -> {n_new:,} ({100 * (n_new - n_source) / n_source:+.2f}%); trained {n_train:,} "
          f"({100 * n_train / n_new:.2f}%); Q/K in the {len(layers)} LISA layers {qk_source:,} -> {qk_new:,} "
          f"({report['qk_params']['compression']:.1f}x fewer)")
    print(f"forward throughput (this device, seq {val.shape[1] - 1}): {tps_source:,.0f} -> {tps_new:,.0f} tokens/s "
          f"({tps_new / tps_source:.2f}x)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"model": dataclasses.asdict(new_cfg), "state_dict": model.state_dict(), "layers": layers},
               out / "lisa_model.pt")
    full = run_config(Path(meta["checkpoint"]))
    if full is not None:
        from pretrain.config import save_config

        full.model = new_cfg
        full.run.dir, full.run.name = str(out), out.name
        full.train.init_from, full.train.resume = str(out / "lisa_model.pt"), "auto"
        save_config(full, out / "config.yaml")
    (out / "conversion.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'lisa_model.pt'}, {out / 'conversion.json'}")
    return 0


if __name__ == "__main__":
    from pretrain.distributed import run_cli

    run_cli(main)
