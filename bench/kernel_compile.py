"""Compile the fused LISA kernels for a GPU without one: registers and spills per kernel and tile.

    python -m bench.kernel_compile [--arch 90] [--depths 1 2] [--out bench/results]

Triton compiles to PTX on any machine and ships NVIDIA's ptxas, so a kernel that would not compile
for the GPU (an operation the interpreter accepts and the compiler does not) fails here, before any
GPU time is spent, and `ptxas -v` gives each kernel's registers and spilled bytes at every tile size
--tiles gives (default: the tile each kernel launches with, lisa_flash_triton.gpu_tiles): spills in
the inner loops cost memory traffic, so they bound the tile sizes worth timing. Sizes are those of
configs/hybrid_1b.yaml (head_dim 128, rank 16, groups of 4, FFN width 16), bf16, softmax sources;
then linear alignment: one head per group (the queries mixed before the kernel) and a chain's
second layer (groups of 4, two stages).
The per-block alignment kernel (lisa_align_triton, where the fused layer does not run) is compiled
too, at its launch sizes. Writes kernel_compile_sm<arch>.json. Needs Triton (not a GPU).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from bench.provenance import provenance

SIZES = dict(G=4, HID=16, NORM=-1, DOCS=False, IEEE=False, DP=128, RP=16, VP=128)
# Names in capitals are pointers (bf16 tensors, but these) unless they are sizes.
FLASH_SIZES = ("H", "NG", "S", "D", "R", "DV", "SHARE_K", "SHARE_V", "PW", "NBLK")
ALIGN_SIZES = ("P", "G", "HID", "GROUPS", "PROGRAMS")
FLOAT32 = ("MIX", "W1", "B1", "W2", "B2", "LSE", "DELTA", "PART", "PARTS")


def signature(kernel, constants: dict, sizes: tuple[str, ...]) -> dict:
    """Argument types for triton.compile: bf16 tensors, fp32 weights and per-row values, int32 sizes."""
    types = {}
    for name in kernel.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in sizes or not name[0].isupper():
            types[name] = "fp32" if name == "seq_len" else "i32"
        elif name in FLOAT32:
            types[name] = "*fp32"
        elif name in ("STARTS", "ENDS"):
            types[name] = "*i32"
        else:
            types[name] = "*bf16"
    return types


def compile_one(kernel, constants: dict, warps: int, arch: int, sizes: tuple[str, ...] = FLASH_SIZES) -> dict:
    """Compile one specialisation; (seconds, registers, spilled bytes, shared memory bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    source = ASTSource(fn=kernel, signature=signature(kernel, constants, sizes),
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps,
                                                                                       num_stages=2))
    seconds = time.perf_counter() - start
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        out = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", ptx.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    return {"compile_s": round(seconds, 1), "registers": int(re.search(r"Used (\d+) registers", out)[1]),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", out)[1]),
            "shared_bytes": compiled.metadata.shared}


def kernels(group: int, hidden: int):
    """(name, jit function, extra constants) of each kernel the fused LISA layer launches at these
    sizes (with one head per group a key block's pass takes the keys' and values' gradients)."""
    import models.attention.kernels.lisa_flash_triton as flash

    launched = [("forward", flash._forward, {}), ("backward_q", flash._backward_q, {"WEIGHTS": False}),
                ("backward_weights", flash._backward_q, {"WEIGHTS": True})]
    if flash.one_head(group, hidden):
        return launched + [("backward_kv", flash._backward_kv, {"KEYS": True, "VALUES": True})]
    return launched + [("backward_kv", flash._backward_kv, {"KEYS": True, "VALUES": False}),
                       ("backward_v", flash._backward_kv, {"KEYS": False, "VALUES": True})]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2],
                        help="alignment stages (2: a chain)")
    parser.add_argument("--tiles", default=None,
                        help="query block,key block,warps[;...] for every kernel (default: each kernel's "
                        "GPU_TILES)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    from models.attention.kernels.lisa_flash_triton import gpu_tiles

    chosen = None
    if args.tiles:
        chosen = [tuple(int(x) for x in tile.split(",")) for tile in args.tiles.split(";")]
    rows = []
    print(f"{'kernel':<18} {'group':>5} {'ffn':>5} {'depth':>5} {'tile':>10} {'warps':>5} {'regs':>5} "
          f"{'spill B':>8} {'smem KB':>8} {'s':>5}")
    # the sizes' groups of 4 heads with the FFN alignment at each depth, then linear alignment: one
    # head alone (mixed queries, one key head per group), and a chain's second layer
    specialisations = [(depth, SIZES["G"], SIZES["HID"]) for depth in args.depths]
    specialisations += [(1, 1, 0), (2, SIZES["G"], 0)]
    for depth, group, hidden in specialisations:
        for name, kernel, extra in kernels(group, hidden):
            for bm, bn, warps in chosen or [gpu_tiles(group, hidden)[name]]:
                constants = dict(SIZES, G=group, HID=hidden, DEPTH=depth, ACC=_float32(), BM=bm, BN=bn,
                                 **extra)
                row = dict(kernel=name, group=group, hidden=hidden, depth=depth, block_q=bm, block_k=bn,
                           warps=warps, **compile_one(kernel, constants, warps, args.arch))
                rows.append(row)
                print(f"{name:<18} {group:>5} {hidden:>5} {depth:>5} {f'{bm}x{bn}':>10} {warps:>5} "
                      f"{row['registers']:>5} {row['spill_bytes']:>8} {row['shared_bytes'] / 1024:>8.1f} "
                      f"{row['compile_s']:>5}", flush=True)
    import models.attention.kernels.lisa_align_triton as align

    block, steps = align.BACKWARD_BLOCKS
    launches = [("align_forward", align._align_forward, dict(BLOCK=256)),  # as fused_align launches them
                ("align_backward", align._align_backward, dict(BLOCK=block, STEPS=steps))]
    for name, kernel, blocks in launches:
        constants = dict(IEEE=False, ACC=_float32(), GP=16, HP=16, **blocks)
        row = dict(kernel=name, block=blocks["BLOCK"],
                   **compile_one(kernel, constants, 4, args.arch, ALIGN_SIZES))
        rows.append(row)
        print(f"{name:<18} {'':>5} {'':>5} {'':>5} {row['block']:>10} {4:>5} {row['registers']:>5} "
              f"{row['spill_bytes']:>8} {row['shared_bytes'] / 1024:>8.1f} {row['compile_s']:>5}", flush=True)
    result = {"arch": args.arch, "sizes": dict(SIZES), "provenance": provenance("bench.kernel_compile", argv),
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernel_compile_sm{args.arch}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


def _float32():
    import triton.language as tl

    return tl.float32


if __name__ == "__main__":
    main()
