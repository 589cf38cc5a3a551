"""The fused LISA kernels (the whole layer, and the per-block alignment) compile for an H100 / H200
(sm_90) on this machine, through Triton's own compiler and ptxas: a kernel the interpreter runs but
the GPU compiler rejects fails here, and so does one that outgrows the GPU's shared memory or spills
more than the budget below."""

from __future__ import annotations

import pytest

SHARED_BYTES = 227 * 1024  # per block on sm_90
SPILL_BUDGET = 1024  # bytes per thread: each kernel at its tile spills at most ~450 (bench/results)


@pytest.mark.slow
def test_fused_lisa_kernels_compile_for_sm90(tmp_path):
    from bench.kernel_compile import main

    result = main(["--depths", "2", "--out", str(tmp_path)])  # each kernel at the tile it launches with
    flash = ["forward", "backward_q", "backward_weights", "backward_kv"]
    # groups of 4 with the FFN alignment in a chain of two, then linear alignment: one head alone (a
    # key block's one pass takes the values' gradients too) and a chain's second layer
    kinds = [(row["kernel"], row.get("group"), row.get("hidden"), row.get("depth")) for row in result["rows"]]
    aligns = [("align_forward", None, None, None), ("align_backward", None, None, None)]
    assert kinds == ([(name, 4, 16, 2) for name in flash + ["backward_v"]]
                     + [(name, 1, 0, 1) for name in flash]
                     + [(name, 4, 0, 2) for name in flash + ["backward_v"]] + aligns), result["rows"]
    for row in result["rows"]:
        assert row["spill_bytes"] <= SPILL_BUDGET and 0 < row["shared_bytes"] <= SHARED_BYTES, row
    # one head alone launches flash attention's 64 x 64 tiles
    assert all(row["block_q"] * row["block_k"] == 64 * 64 for row in result["rows"] if row.get("group") == 1)
    assert (tmp_path / "kernel_compile_sm90.json").exists()


@pytest.mark.slow
def test_fused_lisa_variants_compile_for_sm90():
    """The specialisations the hybrid configs' other layers and the tests' cases take: relu sources
    (prefix normaliser) within documents, linear alignment, one stage, in groups of 2 and of one
    head (at its own tiles, the keys' and values' pass at once); one head per group in a chain of
    two (align_group 1)."""
    import triton.language as tl

    import models.attention.kernels.lisa_flash_triton as flash
    from bench.kernel_compile import SIZES, compile_one

    for group, depth, norm, docs in ((2, 1, 1, True), (1, 1, 1, True), (1, 2, -1, False)):
        both = flash.one_head(group, 0)
        for name, kernel, extra in (("forward", flash._forward, {}),
                                    ("backward_kv", flash._backward_kv, {"KEYS": True, "VALUES": both})):
            bm, bn, warps = flash.gpu_tiles(group, 0)[name]
            constants = dict(SIZES, G=group, HID=0, NORM=norm, DOCS=docs, DEPTH=depth, ACC=tl.float32, BM=bm,
                             BN=bn, **extra)
            row = compile_one(kernel, constants, warps, 90)
            assert row["spill_bytes"] <= SPILL_BUDGET and 0 < row["shared_bytes"] <= SHARED_BYTES, \
                (group, depth, name, row)
