"""Will a layout fit, and how fast will it run? Memory per GPU and step time from the config.

    python -m launch.plan CONFIG [key=value ...] --nodes N --gpus-per-node G --gpu-mem-gb M \
        [--gpu h100|h200|a100|cpu] [--mfu 0.4] [--json]
    python -m launch.plan CONFIG --single-gpu --gpu-mem-gb 141 --gpu h200   # the header's single-GPU layout
    python -m launch.plan RUN/config.yaml --post post.method=dpo ...          # post-training (posttrain.train)

Formulas (per GPU; P = parameters held by this GPU after tensor/expert sharding, D = data-parallel
size, De = expert-data-parallel size D / EP):
  weights        P x 2 bytes (bf16) or 4 (fp32); ZeRO-3 divides by D (De for experts)
  gradients      the .grad tensors (bytes as weights; ZeRO-2/3 free them into buckets) plus, with
                 ZeRO >= 1, the fp32 gradient partition of the optimizer (4 bytes/param / D), but
                 at ZeRO-1 in bf16 the fp32 sum of every gradient (4 bytes/param: DeepSpeed's
                 BF16_Optimizer accumulates and reduces in fp32), and at ZeRO-0 in bf16 the fp32
                 copy of every gradient its optimizer steps on (4 bytes)
  optimizer      fp32 master + Adam m, v = 12 bytes/param (DeepSpeed keeps the master partition
                 even in fp32); ZeRO-1/2/3 divide by D; ZeRO-0 in fp32 steps torch's AdamW on the
                 weights themselves: m, v = 8 bytes/param
  activations    per layer and token, elements: 4h (residual and norm inputs/outputs) plus what
                 the layer's attention and MLP kinds declare (models.registry): for the built-in
                 attention kinds (4h + 3k)/t (q, k, v, rotated q and k, attention output,
                 output-projection input; k = K/V width, h without grouped-query attention) + a*s/t
                 attention scores for kinds that store them (all but flash softmax), for the MLPs
                 4f/t (gate/up output, activation, product; f = active MLP width; 3f/t on a GPU,
                 where the SwiGLU runs fused: no activation), routed MLPs 2kh more for the
                 dispatch's copies (k = top_k) and UoE the SwiGLU's 4/t (3/t) per routing neuron,
                 one more in overlap mode, one more scored by silu, and in overlap mode one more
                 where a rank holds parts of experts (the routing weights spread over their
                 neurons; models/moe/uoe.py: activations); full activation
                 checkpointing keeps h per layer plus one layer's full set, selective drops the
                 scores term (the attention core is recomputed); plus the fp32 logits, 2 x V/t per token;
                 with grouped-GEMM experts (model.moe.grouped_gemm on --gpu) one layer's local
                 experts' weights stacked
  buffers        DeepSpeed's reduce/all-gather buckets (ZeRO-1/2: 2 x min(5e8, P) elements;
                 ZeRO-3: prefetch bucket + live parameters; ZeRO-0 in fp32: one all-reduce bucket
                 of min(5e8, P))
Peak = weights + optimizer + max(activations, gradients + buffers): activations peak at the end
of the forward pass and are freed as the backward pass produces gradients.
Post-training (--post): each example runs the config's rows_per_example() rows of post.max_len
tokens (a DPO pair two, SGA's raw prompt one more), and DPO / SGA add their frozen reference's
(none with SimPO or ORPO) weights (bytes as weights, split over tensor / expert ranks, not by ZeRO) to the
peak and its forward over the pairs to the step's FLOPs.
FLOPs per token: 6 x active matmul parameters + each layer's attention-score FLOPs (12 x hidden x seq,
Megatron's formula, unless its kind counts its own: a LISA layer's low-rank scores and alignment);
step time = FLOPs per step / (GPUs x peak x MFU).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from launch.entry_points import entry_point
from launch.layouts import one_gpu_hint, single_gpu_overrides
from models.config import ModelConfig
from models.counting import expert_params, flops_per_token, param_counts
from models.moe.routing import grouped_gemm_mode
from models.registry import ActivationLayout, attention_kind, mlp_kind
from pretrain.config import Config, ConfigError, load_config, validate
from pretrain.telemetry import peak_tflops

GPUS = ("h100", "h200", "a100", "cpu")  # --gpu: peak from pretrain.telemetry's table (cpu: 1 TFLOP/s)
COMPUTE_CAPABILITY = {"h100": (9, 0), "h200": (9, 0), "a100": (8, 0)}
GIB = 2**30
USABLE_FRACTION = 0.95  # of a GPU's memory: the rest for the allocator's fragmentation and the CUDA context


@dataclass
class Layout:
    world: int
    tensor: int
    expert: int
    data: int
    zero_stage: int
    micro_batch: int
    bf16: bool
    checkpointing: str  # none | full | selective
    grouped_experts: bool = False  # experts run as grouped GEMMs (model.moe.grouped_gemm on the --gpu)
    fused_swiglu: bool = False  # SwiGLU as one kernel (a GPU's Triton kernel; compiled blocks keep as much)


def activation_bytes(cfg: ModelConfig, layout: Layout, seq: int) -> float:
    t, h = layout.tensor, cfg.hidden_size
    elem = 2 if layout.bf16 else 4
    # Flash softmax kernels run in bf16 on GPUs only.
    kinds = ActivationLayout(tensor=t, seq=seq, flash=layout.bf16,
                             selective=layout.checkpointing == "selective", fused_swiglu=layout.fused_swiglu)
    per_layer = [4 * h + attention_kind(kind).activations(cfg, kinds)
                 + mlp_kind(cfg.mlp_kind(layer)).activations(cfg, kinds)
                 for layer, kind in enumerate(cfg.attention_kinds())]
    handed_on = sum(attention_kind(k).handed_on(cfg, kinds) for k in cfg.attention_kinds()
                    if attention_kind(k).handed_on)
    tokens = layout.micro_batch * seq
    if layout.checkpointing == "full":
        layers = cfg.num_layers * h + handed_on + max(per_layer)
    else:
        layers = sum(per_layer) + handed_on
    # fp32 logits and their gradient (with train.z_loss too: models/cross_entropy.py keeps one softmax)
    logits = 2 * cfg.padded_vocab_size / t * 4 / elem
    return tokens * (layers + h + logits) * elem


def peak_bytes(memory: dict[str, float]) -> float:
    return (memory["weights"] + memory["optimizer"] + memory.get("reference", 0.0)
            + max(memory["activations"], memory["gradients"] + memory["buffers"]))


def memory_breakdown(cfg: Config, layout: Layout) -> dict[str, float]:
    m = cfg.model
    counts = param_counts(m)
    experts = expert_params(m)
    dense = counts["total"] - experts
    dense_local = dense / layout.tensor
    expert_local = experts / (layout.tensor * layout.expert)
    expert_dp = max(layout.data // layout.expert, 1)
    elem = 2 if layout.bf16 else 4
    z = layout.zero_stage
    # DeepSpeed keeps a separate fp32 master partition, even in fp32, except at ZeRO-0 in fp32,
    # where torch's AdamW steps the weights themselves
    opt_bytes = 8 if z == 0 and not layout.bf16 else 12

    def sharded(per_param: float, stage_from: int) -> float:
        if z >= stage_from:
            return per_param * (dense_local / layout.data + expert_local / expert_dp)
        return per_param * (dense_local + expert_local)

    local = dense_local + expert_local
    if z >= 3:
        buffers = (5e7 + min(1e9, local)) * elem  # prefetch bucket + live parameters
    elif z >= 1:
        buffers = 2 * min(5e8, local) * elem
    else:  # fp32: the flattened all-reduce bucket; bf16: freed before the step's fp32 gradient copy
        buffers = 0.0 if layout.bf16 else min(5e8, local) * elem
    rows = Layout(**{**layout.__dict__, "micro_batch": layout.micro_batch * cfg.rows_per_example()})
    activations = activation_bytes(m, rows, cfg.tokens_per_row())
    if layout.grouped_experts and expert_local:
        # The grouped GEMMs read a layer's local experts stacked, for the call (forward and backward).
        activations += expert_local * elem / sum(mlp_kind(m.mlp_kind(i)).routed for i in range(m.num_layers))
    memory = {
        "weights": sharded(elem, 3),
        "gradients": (sharded(elem, 2) if z < 2 else 0.0)
        + (sharded(4, 2) if z == 1 and layout.bf16 else sharded(4, 1) if z >= 1 or layout.bf16 else 0.0),
        "optimizer": sharded(opt_bytes, 1),
        "activations": activations,
        "buffers": buffers,
    }
    if cfg.holds_reference_model():  # split like the policy over tensor / expert ranks, never by ZeRO
        memory["reference"] = elem * local
    return memory


def plan(cfg: Config, nodes: int, gpus_per_node: int, gpu_mem_gb: float, gpu: str = "h100",
         mfu: float = 0.4, bf16: bool | None = None) -> dict:
    """`bf16` None: as train.precision (auto: bf16 unless `gpu` is cpu)."""
    world = nodes * gpus_per_node
    validate(cfg, world)
    p, t = cfg.parallel, cfg.train
    if bf16 is None:
        bf16 = {"bf16": True, "fp32": False}.get(t.precision, gpu != "cpu")
    moe = cfg.model.moe
    # the routed experts' width: UoE's rest neurons, a router MoE's expert_hidden_size (validate
    # refuses sizing=carved for it, the only case where the two differ)
    grouped = grouped_gemm_mode(moe.grouped_gemm, COMPUTE_CAPABILITY.get(gpu), cfg.model.hidden_size,
                                moe.rest_neurons() // p.tensor).runs(bf16)
    # Not for train.compile on a CPU: its routed experts run eagerly unless grouped (the formula).
    fused_swiglu = gpu != "cpu"
    layout = Layout(world, p.tensor, p.expert, world // p.tensor, p.zero_stage, t.micro_batch, bf16,
                    t.activation_checkpointing, grouped, fused_swiglu)
    memory = memory_breakdown(cfg, layout)
    total = peak_bytes(memory)
    usable = gpu_mem_gb * GIB * USABLE_FRACTION
    fits = total <= usable
    largest = 0
    for micro in range(1, 257):
        trial = Layout(**{**layout.__dict__, "micro_batch": micro})
        if peak_bytes(memory_breakdown(cfg, trial)) > usable:
            break
        largest = micro
    tokens_per_step = t.micro_batch * cfg.rows_per_example() * t.grad_accum * layout.data * cfg.tokens_per_row()
    fpt = flops_per_token(cfg.model)
    # a frozen reference runs the pairs forward only: a third of a training pass over them
    reference = 2 / cfg.rows_per_example() / 3 if cfg.holds_reference_model() else 0.0
    peak = 1.0 if gpu == "cpu" else peak_tflops(gpu, bf16)  # an fp32 plan runs at the fp32 peak
    step_time = fpt * (1 + reference) * tokens_per_step / (world * peak * 1e12 * mfu)
    counts = param_counts(cfg.model)
    result = {
        "layout": layout.__dict__, "params_total": counts["total"], "params_active": counts["active"],
        "flops_per_token": fpt, "memory_gb": {k: v / GIB for k, v in memory.items()},
        "memory_total_gb": total / GIB, "gpu_mem_gb": gpu_mem_gb, "usable_gb": usable / GIB, "fits": fits,
        "largest_micro_batch": largest, "rows_per_example": cfg.rows_per_example(), "seq": cfg.tokens_per_row(),
        "tokens_per_step": tokens_per_step,
        "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time, "assumed_mfu": mfu, "gpu": gpu,
    }
    if not fits:
        result["reason"] = (
            f"needs {total / GIB:.1f} GB per GPU but {usable / GIB:.1f} GB are usable ({gpu_mem_gb:g} GB less "
            f"{1 - USABLE_FRACTION:.0%} for the allocator and the CUDA context); "
            + (f"the largest micro-batch that fits is {largest}" if largest else
               "no micro-batch fits: raise parallel.tensor / parallel.zero_stage or enable "
               "train.activation_checkpointing")
        )
    return result


def format_plan(r: dict) -> str:
    lay = r["layout"]
    lines = [
        f"parameters: {r['params_total'] / 1e9:.3f}B total, {r['params_active'] / 1e9:.3f}B active; "
        f"{r['flops_per_token'] / 1e9:.2f} GFLOP per token",
        f"layout: {lay['world']} GPUs = tensor {lay['tensor']} x data {lay['data']} (expert {lay['expert']}), "
        f"ZeRO-{lay['zero_stage']}, micro-batch {lay['micro_batch']}"
        + (f" ({lay['micro_batch'] * r['rows_per_example']} rows)" if r["rows_per_example"] > 1 else "")
        + f" x {r['seq']} tokens, activation checkpointing {lay['checkpointing']}",
        f"{'memory per GPU':<16}{'GB':>10}",
    ]
    for key, value in r["memory_gb"].items():
        lines.append(f"  {key:<14}{value:>10.2f}")
    lines.append(f"  {'peak':<14}{r['memory_total_gb']:>10.2f}  of {r['usable_gb']:.2f} usable "
                 f"({r['gpu_mem_gb']:g} GB less {1 - USABLE_FRACTION:.0%}) -> "
                 f"{'fits' if r['fits'] else 'DOES NOT FIT'}")
    lines.append(f"largest micro-batch that fits: {r['largest_micro_batch']}")
    lines.append(f"estimated step time {r['step_time_s']:.2f} s, {r['tokens_per_s']:,.0f} tokens/s "
                 f"at {100 * r['assumed_mfu']:.0f}% MFU on {r['gpu']}")
    if not r["fits"]:
        lines.append(f"reason: {r['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--nodes", type=int, default=None, help="default 1")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default 8")
    parser.add_argument("--gpu-mem-gb", type=float, default=80.0)
    parser.add_argument("--gpu", choices=GPUS, default="h100")
    parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--post", action="store_true",
                        help="a post-training config (posttrain.train): rows per example, post.max_len, the frozen "
                             "reference of DPO / SGA")
    parser.add_argument("--single-gpu", action="store_true",
                        help="one GPU, with the config header's single-GPU layout before the overrides")
    args = parser.parse_intermixed_args(argv)
    if args.single_gpu and (args.nodes is not None or args.gpus_per_node is not None):
        parser.error("--single-gpu plans one GPU; drop --nodes / --gpus-per-node")
    args.nodes = 1 if args.nodes is None else args.nodes
    args.gpus_per_node = (1 if args.single_gpu else 8) if args.gpus_per_node is None else args.gpus_per_node
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                        ("--gpu-mem-gb", args.gpu_mem_gb)):
        if value <= 0:
            parser.error(f"{flag} {value} must be positive")
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu {args.mfu} must be a fraction in (0, 1], e.g. 0.4")
    overrides = args.overrides
    try:
        if args.single_gpu:
            overrides = single_gpu_overrides(args.config) + overrides
        cfg = load_config(args.config, overrides, config_class=entry_point(args.post).config_class)
        result = plan(cfg, args.nodes, args.gpus_per_node, args.gpu_mem_gb, args.gpu, args.mfu)
    except ConfigError as err:
        hint = "" if args.single_gpu else one_gpu_hint(err, args.config, args.nodes * args.gpus_per_node)
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_plan(result))
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
