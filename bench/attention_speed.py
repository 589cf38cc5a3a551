"""Attention forward + backward time per kind, relative to softmax in the same run.

    python -m bench.attention_speed [--seqs 256,1024,2048] [--hidden 256] [--heads 4] [--out bench/results]

Times one attention module (projections + core + output projection) in one process (TP = 1) on
whatever device is present. Kinds: softmax (SDPA), softmax_gqa (one K/V head for all query heads),
softmax_sink (on a GPU FlexAttention, else SDPA with a sink column), relu (the fused Triton kernels
on a GPU, else blocked PyTorch), relu_torch (always the PyTorch path), lisa (the scores a softmax layer hands over, align
FFN + low-rank Q/K: on a GPU one fused kernel, models/attention/kernels/lisa_flash_triton.py, else
built by query blocks), lisa_torch (by query blocks in PyTorch, model.lisa.kernel=torch), lisa_linear
(model.lisa.align_hidden = 0: linear head mixing in groups of 4 heads, each reading 4 K/V heads: on a
GPU the fused kernel, else attending over score features), lisa_linear_torch (over score features
everywhere, model.lisa.kernel=torch), lisa_linear_gqa (the same after a grouped-query layer whose
one K/V head serves the alignment group: on a GPU the fused kernel on the mixed queries, one head at
a time, else attending over features of width head_dim + rank), lisa_linear_torch_gqa (over those
features everywhere), lisa_naive
(lisa_linear on explicit scores, model.lisa.kernel=naive), lisa_ffn_naive (lisa on explicit
scores) and softmax+publish (a softmax layer that hands its scores to a following LISA layer).
lisa_chain and lisa_linear_chain_gqa time lisa and lisa_linear_gqa as the hybrid configs place LISA
layers, two in a row after a full layer (the second reads what the first hands on; kept chain scores
as in configs/hybrid_*.yaml): their time and kept memory are the mean per LISA layer. A
kind with `_bs<rows>` appended (lisa_bs256) runs its query blocks at that size instead of the
default model.lisa.block_size / model.relu_attention.block_size.
`kept MB` is the memory one forward allocates and still holds when it returns (what its backward
needs, and the output; the layer's input and the handed-over queries and keys are allocated
before): the CPU profiler's memory count, or the CUDA allocator's. `decode_ms_per_token` times
decoding with the KV cache through the Hugging Face modeling file (models/hf), for bench.gpu_check.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from bench.provenance import provenance

KINDS = ["softmax", "softmax_gqa", "softmax_sink", "relu", "relu_torch", "lisa", "lisa_torch", "lisa_linear",
         "lisa_linear_torch", "lisa_linear_gqa", "lisa_linear_torch_gqa", "lisa_chain",
         "lisa_linear_chain_gqa", "lisa_naive", "lisa_ffn_naive", "softmax+publish"]


class LISAChain(torch.nn.Module):
    """Layers 1 and 2 of (full, lisa, lisa): the second reads the scores the first hands on, as
    models.gpt's blocks pass them; both take the same input, and their outputs are summed."""

    layers = 2

    def __init__(self, cfg):
        from models.registry import build_attention

        super().__init__()
        self.first, self.second = build_attention(cfg, 1), build_attention(cfg, 2)

    def forward(self, x: torch.Tensor, ctx: dict) -> torch.Tensor:
        out = self.first(x, ctx)
        handed_on = ctx.pop("published_scores")
        return out + self.second(x, {**ctx, "shared_scores": handed_on})


def build(kind: str, hidden: int, heads: int, seq: int):
    from models.config import ModelConfig
    from models.registry import build_attention

    kind, _, rows = kind.partition("_bs")
    chain = "_chain" in kind
    kind = kind.replace("_chain", "")
    cfg = ModelConfig(hidden_size=hidden, num_heads=heads, num_layers=2, max_seq_len=seq, attention="softmax",
                      num_kv_heads=1 if kind.endswith("_gqa") else 0)
    if rows:
        cfg.lisa.block_size = cfg.relu_attention.block_size = int(rows)
    cfg.lisa.keep_full_layers = 1
    cfg.lisa.align_group = min(4, heads)  # as in configs/hybrid_*.yaml
    if kind.startswith("lisa"):
        cfg.attention = "softmax,lisa,lisa" if chain else "softmax,lisa"
        cfg.num_layers = 3 if chain else 2
        cfg.lisa.keep_chain_scores = chain
        ffn = kind in ("lisa", "lisa_torch", "lisa_ffn_naive")
        cfg.lisa.align_hidden = cfg.lisa.align_hidden if ffn else 0
        cfg.lisa.kernel = "naive" if kind.endswith("_naive") else "torch" if "_torch" in kind else "auto"
        return (LISAChain(cfg) if chain else build_attention(cfg, 1)), cfg
    cfg.attention = {"softmax+publish": "softmax", "relu_torch": "relu", "softmax_gqa": "softmax"}.get(kind, kind)
    cfg.relu_attention.kernel = "torch" if kind == "relu_torch" else "auto"
    module = build_attention(cfg, 0)
    module.publish_scores = kind == "softmax+publish"
    return module, cfg


def layer_and_inputs(kind: str, hidden: int, heads: int, seq: int, batch: int, device,
                      documents: torch.Tensor | None, dtype: torch.dtype):
    """The module, its input x and a function giving a fresh ctx with what the previous (softmax)
    layer hands a LISA layer: its rotated queries and keys."""
    from models.attention.shared_scores import SharedScores
    from models.layers import Rotary

    module, cfg = build(kind, hidden, heads, seq)
    module = module.to(device, dtype)
    rotary = Rotary(cfg.head_dim, seq, cfg.rope_base).to(device)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    q, k = (torch.randn(batch, n, seq, cfg.head_dim, device=device, dtype=dtype, requires_grad=True)
            for n in (heads, cfg.kv_heads))

    block_mask = None
    if (documents is not None or kind.startswith("softmax_sink")) and torch.device(device).type == "cuda":
        from models.attention.flex import document_block_mask

        # once, as a model's forward does for all layers (the sink kind's causal one too)
        block_mask = document_block_mask(documents, seq, seq, device)

    def ctx() -> dict:
        out = {"rotary": rotary, "shared_scores": SharedScores.of_projection(q, k), "document_ids": documents}
        if block_mask is not None:
            out["flex_block_mask"] = block_mask
        return out

    return module, (x, q, k), ctx


def time_kind(kind: str, hidden: int, heads: int, seq: int, batch: int, repeats: int, device,
              documents: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> float:
    """Median seconds of one forward + backward (``documents``: attend within them, [batch, seq]); per
    layer for a chain."""
    layer = layer_and_inputs(kind, hidden, heads, seq, batch, device, documents, dtype)
    times = [one_step(layer, device) for _ in range(repeats + 1)][1:]  # the first call is warm-up
    return statistics.median(times)


def one_step(layer, device) -> float:
    """Seconds of one forward + backward of layer_and_inputs' (module, inputs, ctx); per layer for a chain."""
    module, (x, q, k), ctx = layer
    inputs = ctx()  # outside the timed region: a model builds them once per forward for all layers
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    module(x, inputs).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    x.grad = q.grad = k.grad = None
    module.zero_grad(set_to_none=True)
    return seconds / getattr(module, "layers", 1)


def time_in_turn(kinds: list[str], hidden: int, heads: int, seq: int, batch: int, repeats: int,
                 device) -> dict[str, list[float]]:
    """{kind: seconds of each repeat}, the kinds timed in turn within every repeat, so that a slow
    stretch of a noisy machine falls on all of them alike (ratios are then taken per repeat)."""
    layers = {k: layer_and_inputs(k, hidden, heads, seq, batch, device, None, torch.float32) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(repeats + 1):
        for k in kinds:
            seconds = one_step(layers[k], device)
            if i:  # the first round is warm-up
                times[k].append(seconds)
    return times


def reference_kind(kind: str) -> str:
    """What a kind is compared with: softmax_gqa for grouped-query kinds (_gqa, also before a _bs
    block-size suffix), else softmax."""
    return "softmax_gqa" if kind.partition("_bs")[0].endswith("_gqa") else "softmax"


def kept_bytes(kind: str, hidden: int, heads: int, seq: int, batch: int, device,
               documents: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one forward allocates and still holds when it returns (for backward, and the output); per
    layer for a chain."""
    module, (x, _, _), ctx = layer_and_inputs(kind, hidden, heads, seq, batch, device, documents, dtype)
    inputs, layers = ctx(), getattr(module, "layers", 1)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = module(x, inputs)
        torch.cuda.synchronize()
        return (torch.cuda.memory_allocated() - before) // layers
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = module(x, inputs)  # noqa: F841 - held until counted
    return sum(event.self_cpu_memory_usage for event in prof.key_averages()) // layers


DECODE_LAYERS = {"softmax": ["softmax", "softmax"], "softmax_sink": ["softmax", "softmax_sink"],
                 "relu": ["softmax", "relu"], "lisa": ["softmax", "lisa"], "lisa_linear": ["softmax", "lisa"]}


@torch.no_grad()
def decode_ms_per_token(kind: str, hidden: int, heads: int, prompt: int, new_tokens: int, device,
                        dtype: torch.dtype = torch.bfloat16) -> dict:
    """A two-layer model (softmax, then `kind`) of the Hugging Face modeling file, random weights:
    {"prefill_ms", "decode_ms_per_token"} for a `prompt`-token prefill, then `new_tokens` tokens one
    at a time with the KV cache (the median step)."""
    from tools.export import _remote_module

    hf = _remote_module()
    kinds = DECODE_LAYERS[kind]
    config = hf.UoEPretrainConfig(
        vocab_size=512, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
        intermediate_size=4 * hidden, max_position_embeddings=prompt + new_tokens, attention_kinds=kinds,
        lisa_sources=[None, "softmax" if kind.startswith("lisa") else None], lisa_rank=max(2, hidden // heads // 8),
        lisa_align_hidden=0 if kind == "lisa_linear" else 16,
        mlp_kinds=["dense", "dense"])
    model = hf.UoEPretrainForCausalLM(config).to(device, dtype).eval()
    tokens = torch.randint(0, 512, (1, prompt + new_tokens), device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    prefills = []
    for _ in range(2):  # the first: one-time costs (CUDA libraries, kernel compiles), not timed
        sync()
        t0 = time.perf_counter()
        out = model(tokens[:, :prompt], use_cache=True)
        sync()
        prefills.append(time.perf_counter() - t0)
    prefill = prefills[-1]
    cache, steps = out.past_key_values, []
    for i in range(prompt, prompt + new_tokens):
        t0 = time.perf_counter()
        cache = model(tokens[:, i:i + 1], past_key_values=cache, use_cache=True).past_key_values
        sync()
        steps.append(time.perf_counter() - t0)
    return {"prefill_ms": 1000 * prefill, "decode_ms_per_token": 1000 * statistics.median(steps[1:] or steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="256,1024,2048")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="attention_speed", help="the result file's name, OUT/NAME.json")
    args = parser.parse_args(argv)
    from pretrain.distributed import destroy_distributed, device, init_single_process

    init_single_process()
    dev = device()
    seqs = [int(s) for s in args.seqs.split(",")]
    kinds = args.kinds.split(",")
    name_width = max(16, *(len(k) + 1 for k in kinds))
    rows = []
    missing = sorted({reference_kind(k) for k in kinds} - set(kinds))
    if missing:
        raise SystemExit(f"--kinds: add {', '.join(missing)}, the reference the ratios are taken against")
    print(f"attention forward+backward, batch {args.batch}, hidden {args.hidden}, heads {args.heads}, "
          f"device {dev.type} ({torch.get_num_threads()} threads), {args.repeats} repeats with the kinds in turn; "
          "median ms, and the median [range] of the per-repeat ratios")
    columns = "".join(f"{f'seq {s} ms':>14}{'x softmax [range]':>22}{'kept MB':>9}" for s in seqs)
    print(f"{'kind':<{name_width}}" + columns + "   (_gqa kinds against softmax_gqa)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": dev.type, "threads": torch.get_num_threads(), "batch": args.batch, "hidden": args.hidden,
            "heads": args.heads, "repeats": args.repeats, **provenance("bench.attention_speed", argv)}
    path = out / f"{args.name}.json"
    cells = {}  # (kind, seq) -> its row
    for s in seqs:  # the file is rewritten after each length: a later failure keeps the finished ones
        times = time_in_turn(kinds, args.hidden, args.heads, s, args.batch, args.repeats, dev)
        for k in kinds:
            ratios = [a / b for a, b in zip(times[k], times[reference_kind(k)])]
            cells[k, s] = {"kind": k, "seq": s, "ms": 1000 * statistics.median(times[k]),
                           "relative_to_softmax": statistics.median(ratios),
                           "relative_range": [min(ratios), max(ratios)],
                           "kept_mb": kept_bytes(k, args.hidden, args.heads, s, args.batch, dev) / 2**20}
        rows[:] = [cells[k, s2] for k in kinds for s2 in seqs if (k, s2) in cells]
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    for k in kinds:
        line = f"{k:<{name_width}}"
        for s in seqs:
            c = cells[k, s]
            rel, (low, high) = c["relative_to_softmax"], c["relative_range"]
            line += f"{c['ms']:>14.1f}{f'{rel:.2f} [{low:.2f}-{high:.2f}]':>22}{c['kept_mb']:>9.1f}"
        print(line)
    print(f"wrote {path}")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
