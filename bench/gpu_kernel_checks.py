"""The GPU check's kernel checks (bench.gpu_check runs each in a process of its own): grouped GEMMs,
the Triton ReLU kernels and the fused LISA kernels (alignment, whole layer, decode) against the
PyTorch paths or float64 references. Each takes the device and returns a dict with "match"; with
--device cpu the Triton ones run under Triton's interpreter at tiny sizes."""

from __future__ import annotations

import statistics
import time

import torch


def grouped_gemm_check(device: str) -> dict:
    """bf16 grouped GEMMs (torch._grouped_mm; CUTLASS's kernel on Hopper) against the per-expert
    loop: the loss and all gradients of one forward and backward of a tiny UoE model."""
    from bench.gpu_check import FAMILIES, tiny  # the tiny UoE of the correctness check
    from models.gpt import GPT
    from models.moe.routing import GroupedGemm
    from pretrain.config import load_config

    cfg_path = FAMILIES["uoe-1b"][0]
    cfg = load_config(cfg_path, tiny(cfg_path) + ["parallel.expert=1", "model.moe.grouped_gemm=false"])
    torch.manual_seed(0)
    model = GPT(cfg.model).to(device=device, dtype=torch.bfloat16)
    batch = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(0)).to(device)
    runs = []
    for grouped in (False, True):
        for module in model.modules():
            if hasattr(module, "grouped_gemm"):  # the expert dispatchers
                module.grouped_gemm = GroupedGemm(enabled=grouped)
        model.zero_grad()
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        runs.append((loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()])))
    (loss_loop, grads_loop), (loss_grouped, grads_grouped) = runs
    grad_diff = ((grads_grouped - grads_loop).norm() / grads_loop.norm()).item()
    return {"loss_per_expert": loss_loop, "loss_grouped": loss_grouped, "grad_rel_diff": grad_diff,
            "match": abs(loss_grouped - loss_loop) <= 1e-2 * abs(loss_loop) and grad_diff <= 2e-2}


def relu_kernel_check(device: str) -> dict:
    """The Triton ReLU kernels (fp32, and bf16 as training runs them) against the PyTorch path in
    float64: output and every gradient, grouped-query heads, queries/keys wider than the values
    (LISA's features), within documents. --device cpu runs them under Triton's interpreter at tiny
    sizes."""
    from models.attention.kernels.relu_triton import triton_relu_attention
    from models.attention.relu import relu_attention

    cpu = device == "cpu"  # a smoke test of the check: the suite tests the kernels under the interpreter
    seq, widths, normalizers = (40, ((24, 16),), ("content",)) if cpu else (300, ((64, 64), (72, 64)), ("prefix", "content"))
    documents = torch.zeros(2, seq, dtype=torch.long, device=device)
    documents[0, seq // 5:] += 1
    documents[0, seq // 2:] += 1
    cases = [(w, d, n, torch.float32) for w in widths for d in (None, documents) for n in normalizers]
    if not cpu:
        cases += [(widths[-1], d, "content", torch.bfloat16) for d in (None, documents)]
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to the largest entry
    errors, ok = {}, True
    gen = torch.Generator().manual_seed(0)
    for (d_qk, d_v), docs, normalizer, dtype in cases:
        q, k, v = (torch.randn(2, heads, seq, d, generator=gen).to(device, dtype).requires_grad_()
                   for heads, d in ((4, d_qk), (2, d_qk), (2, d_v)))
        grad_out = torch.randn(2, 4, seq, d_v, generator=gen).to(device, dtype)
        out = triton_relu_attention(q, k, v, normalizer, documents=docs)
        got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = relu_attention(qd, kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1), normalizer, 64, docs)
        want = (ref, *torch.autograd.grad(ref, (qd, kd, vd), grad_out.double()))
        case = f"{d_qk}/{d_v} {'docs' if docs is not None else 'causal'} {normalizer} {str(dtype)[6:]}"
        errors[case] = max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
        ok &= errors[case] < tolerance[dtype]
    return {"max_rel_error": errors, "match": ok}


def lisa_align_check(device: str) -> dict:
    """The fused LISA alignment kernel (models.attention.kernels.lisa_align_triton; fp32, and bf16 as
    training runs it) against HeadAlign in float64: output and the gradients of the scores and of
    every alignment weight, groups of 4 at the 1B hybrid's hidden width 16 and of 3 at width 5.
    --device cpu runs it under Triton's interpreter at tiny sizes."""
    from models.attention.kernels.lisa_align_triton import fused_align
    from models.attention.lisa import HeadAlign

    rows, keys = (5, 40) if device == "cpu" else (128, 1000)
    cases = [(16, 4, 16, torch.float32), (6, 3, 5, torch.float32)]
    if device != "cpu":
        cases.append((16, 4, 16, torch.bfloat16))
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to the largest entry
    errors, ok = {}, True
    gen = torch.Generator().manual_seed(0)
    for heads, group, hidden, dtype in cases:
        align = HeadAlign(heads, heads, group, hidden).double()
        with torch.no_grad():
            for p in align.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        scores = torch.randn(2, heads, rows, keys, generator=gen, dtype=torch.float64)
        grad_out = torch.randn(scores.shape, generator=gen, dtype=torch.float64)
        ref = align(scores.requires_grad_(), recompute_rows=False)
        params = [align.mix, align.w1, align.b1, align.w2, align.b2]
        want = (ref, *torch.autograd.grad(ref, [scores, *params], grad_out))
        inputs = [t.detach().to(device, dtype).requires_grad_() for t in (scores, *params)]
        out = fused_align(*inputs)
        got = (out, *torch.autograd.grad(out, inputs, grad_out.to(device, dtype)))
        case = f"{group}x{hidden} {str(dtype)[6:]}"
        errors[case] = max(float((a.double().cpu() - b).abs().max() / b.abs().max())
                           for a, b in zip(got, want))
        ok &= errors[case] < tolerance[dtype]
    return {"max_rel_error": errors, "match": ok}


def lisa_test_model(attention: str, sizes: dict, kernel: str = "auto", align_hidden: int = 16):
    """A GPT of these kinds (model.attention) and sizes whose LISA layers (alignment groups of 4)
    have random low-rank keys and alignment weights at their scale: they start at zero."""
    from models.attention.lisa import LISAAttention
    from models.config import ModelConfig
    from models.gpt import GPT

    cfg = ModelConfig(attention=attention, **sizes)
    cfg.lisa.keep_full_layers, cfg.lisa.align_group, cfg.lisa.kernel = 1, 4, kernel
    cfg.lisa.align_hidden = align_hidden
    torch.manual_seed(0)
    model, noise = GPT(cfg), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            if isinstance(block.attn, LISAAttention):
                block.attn.qk.weight.add_(torch.randn(block.attn.qk.weight.shape, generator=noise) * 0.02)
                for param in block.attn.align.parameters():
                    param.add_(torch.randn(param.shape, generator=noise) * 0.2)
    return model


def lisa_flash_check(device: str) -> dict:
    """The fused LISA kernel (models.attention.kernels.lisa_flash_triton) in a model against the
    explicit scores in float64 (model.lisa.kernel auto / naive): a softmax layer, or a relu layer
    within documents, then two LISA layers (the second runs the chain of both alignments), FFN
    alignment in groups of 4, grouped-query heads (4 query heads per K/V head), random alignment and
    low-rank weights; and the softmax case with linear alignment, whose first LISA layer the kernel
    runs on the mixed queries and the second on the first one's mixed queries and keys. Per case:
    the largest error of the loss and of every gradient (error()), and how often the kernel ran (two
    layers per forward, or the case fails). On a GPU in bf16, the kernel's type there: passes under
    twice the PyTorch path's bf16 error (kernel=torch), or under 3e-2, and under 0.1 in any case.
    --device cpu runs it in fp32 under Triton's interpreter at tiny sizes (passes under 1e-4)."""
    import models.attention.kernels.lisa_flash_triton as fused

    cpu = device == "cpu"
    hidden, heads, seq = (64, 4, 24) if cpu else (2048, 16, 1024)
    dtype, dev = torch.float32 if cpu else torch.bfloat16, torch.device(device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (1, seq + 1), generator=gen).to(dev)
    documents = torch.cumsum(torch.rand(1, seq, generator=gen) < 8 / seq, 1).to(dev)  # about 8
    sizes = dict(vocab_size=512, hidden_size=hidden, num_heads=heads, num_kv_heads=heads // 4, num_layers=3,
                 ffn_hidden_size=2 * hidden, max_seq_len=seq)
    calls = []
    kernel = fused.flash_lisa
    fused.flash_lisa = lambda *args: calls.append(1) or kernel(*args)

    def run(case: str, kernel: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
        attention, linear = case.split()[0], "linear" in case
        model = lisa_test_model(attention, sizes, kernel, align_hidden=0 if linear else 16).to(dev, dtype)
        loss = model(tokens[:, :-1], tokens[:, 1:], documents if attention == "rll" else None)
        loss.backward()
        return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}

    def error(got, want) -> float:
        """Of the loss and of each gradient, relative to its largest entry, or to a thousandth of the
        model's largest gradient entry where that is more (a softmax-fed b2's is zero up to rounding)."""
        (loss, grads), (ref_loss, ref_grads) = got, want
        floor = 1e-3 * max(float(g.abs().max()) for g in ref_grads.values())
        errs = [float((loss - ref_loss).abs() / ref_loss.abs())]
        errs += [float((grads[n] - g).abs().max()) / max(float(g.abs().max()), floor) for n, g in ref_grads.items()]
        return max(errs)

    errors, pytorch, ran, ok = {}, {}, {}, True
    for layers in ("sll", "rll docs", "sll linear"):  # softmax; relu (prefix) within documents
        case = f"{layers} {str(dtype)[6:]}"
        want = run(layers, "naive", torch.float64)
        before = len(calls)
        errors[case] = error(run(layers, "auto", dtype), want)
        ran[case] = len(calls) - before
        ok &= ran[case] == 2
        if cpu:
            ok &= errors[case] < 1e-4
        else:
            pytorch[case] = error(run(layers, "torch", dtype), want)
            ok &= errors[case] < min(0.1, max(3e-2, 2 * pytorch[case]))
    fused.flash_lisa = kernel
    return {"max_rel_error": errors, "pytorch_bf16_error": pytorch, "kernel_calls": ran, "match": ok}


def lisa_decode_check(device: str) -> dict:
    """The fused LISA decode kernel (models.attention.kernels.lisa_decode_triton) against the PyTorch
    path on the same model (model.lisa.kernel auto / naive): a softmax layer feeding two LISA layers
    (FFN alignment in groups of 4, grouped-query heads; random alignment and low-rank weights), the
    same tokens decoded one at a time after a prefill. Per batch: each path's logits against the
    PyTorch path in fp32 (largest difference relative to the largest logit: in bf16 the paths round
    differently, so the fused one passes when its error is under twice the PyTorch path's, or under
    3e-2, and under 0.1 in any case), and the median ms per decode step of both paths and of the same
    model with softmax layers only. --device cpu: under Triton's interpreter at tiny sizes, in fp32."""
    from models.attention.kv_cache import KVCache
    from models.attention.lisa import LISAAttention

    cpu = device == "cpu"
    hidden, heads, context, steps, batches = (64, 8, 20, 3, (1, 2)) if cpu else (2048, 16, 4096, 32, (1, 8))
    dtype, dev = torch.float32 if cpu else torch.bfloat16, torch.device(device)
    sizes = dict(vocab_size=512, hidden_size=hidden, num_heads=heads, num_kv_heads=heads // 4, num_layers=3,
                 ffn_hidden_size=4 * hidden, max_seq_len=context + steps)

    def build(attention: str):
        return lisa_test_model(attention, sizes).to(dev).eval()

    reference = build("sll")  # in fp32: the PyTorch path's logits as the reference for both paths
    models = {"lisa": build("sll").to(dtype), "softmax": build("sss").to(dtype)}
    gen = torch.Generator().manual_seed(0)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def decode(model, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
        cache = KVCache(context + steps)
        model.logits(tokens[:, :context], {"kv_cache": cache})
        logits, times = [], []
        for i in range(context, context + steps):
            sync()
            t0 = time.perf_counter()
            logits.append(model.logits(tokens[:, i:i + 1], {"kv_cache": cache}).float())
            sync()
            times.append(time.perf_counter() - t0)
        return torch.cat(logits, 1), 1000 * statistics.median(times[1:])

    def use_kernel(model, kernel: str):
        for block in model.blocks:
            if isinstance(block.attn, LISAAttention):
                block.attn.kernel = kernel
        return model

    result, ok = {}, True
    for batch in batches:
        tokens = torch.randint(0, 512, (batch, context + steps), generator=gen).to(dev)
        row = {}
        want, _ = decode(use_kernel(reference, "naive"), tokens)
        for kernel in ("auto", "naive"):
            row[kernel], row[f"{'fused' if kernel == 'auto' else 'pytorch'}_ms"] = decode(
                use_kernel(models["lisa"], kernel), tokens)
        _, row["softmax_ms"] = decode(models["softmax"], tokens)
        fused, naive = row.pop("auto"), row.pop("naive")
        scale = want.abs().max()
        row["max_rel_diff"] = float((fused - naive).abs().max() / scale)
        row["fused_error"], row["pytorch_error"] = (float((got - want).abs().max() / scale)
                                                    for got in (fused, naive))
        row["fused_x_pytorch"] = row["pytorch_ms"] / row["fused_ms"]
        ok &= row["fused_error"] < (1e-4 if cpu else min(0.1, max(3e-2, 2 * row["pytorch_error"])))
        result[f"batch {batch} x {context}"] = row
    return {"rows": result, "match": ok}
