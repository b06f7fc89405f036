"""Development check on the H200 for issue 15 (FP8 FA3 and FlashInfer block-sparse): API, correctness against the
CPU references, first timings. ``python benchmarks/h200/hopper_dev.py fp8|sparse|jit``."""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from diffusers_omni.attention import block_sparse as bs  # noqa: E402
from diffusers_omni.attention import fp8_quant as fq  # noqa: E402


def ms(fn, reps=10, inner=3):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / inner)
    return statistics.median(out)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ref32(q, k, v):
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


def fp8():
    import fa3_fwd_interface as fa3

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k = k + torch.randn(1, 1, 4, 128, device="cuda", dtype=torch.bfloat16)
    a = fq.quantize_qkv(q, k, v)
    r = fq.quantize_qkv_reference(q, k, v)
    for n in "qkv":
        print(n, "triton==reference bytes:", torch.equal(getattr(a, n).view(torch.uint8), getattr(r, n).view(torch.uint8)))
    print("descales equal", torch.equal(a.q_descale, r.q_descale), torch.equal(a.k_descale, r.k_descale))
    out = fq.fp8_attention(fa3.flash_attn_func, q, k, v)
    print("fp8 out", out.dtype, out.shape, "vs fake-quant reference", rel(out, fq.fp8_attention_reference(a)),
          "vs fp32", rel(out, ref32(q, k, v)))
    shapes = [("FLUX self", 1, 24, 4608, 4608), ("Wan self", 1, 40, 32760, 32760), ("Wan cross", 1, 40, 32760, 512),
              ("Hunyuan self", 1, 16, 54000, 54000)]
    for label, b, h, sq, skv in shapes:
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, skv, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        quant = fq.quantize_qkv(q, k, v)
        t_bf16 = ms(lambda: fa3.flash_attn_func(q, k, v))
        t_quant = ms(lambda: fq.quantize_qkv(q, k, v))
        t_kernel = ms(lambda: fa3.flash_attn_func(quant.q, quant.k, quant.v, q_descale=quant.q_descale,
                                                  k_descale=quant.k_descale, v_descale=quant.v_descale))
        t_all = ms(lambda: fq.fp8_attention(fa3.flash_attn_func, q, k, v))
        err = rel(fq.fp8_attention(fa3.flash_attn_func, q, k, v), ref32(q, k, v)) if sq * skv < 2e9 else float("nan")
        print(f"{label}: bf16 {t_bf16:.3f} ms, quant {t_quant:.3f}, fp8 kernel {t_kernel:.3f}, whole {t_all:.3f} "
              f"-> {t_bf16 / t_all:.3f}x; rel err {err:.3e}", flush=True)


def sparse():
    torch.manual_seed(0)
    runner = bs.BlockSparseRunner()
    for s, order in ((3000, None), (3000, torch.randperm(3000))):
        layout = bs.SparseLayout(s, order, dense_query_blocks=1 if order is not None else 0,
                                 forced_key_blocks=(0, 1) if order is not None else ())
        q, k, v = (torch.randn(1, s, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, mask = runner(q, k, v, layout, 0.5, return_mask=True)
        print("sparse vs mask->SDPA reference", rel(out, bs.block_sparse_reference(q, k, v, layout, mask)),
              "kept", mask.float().mean().item())
    import fa3_fwd_interface as fa3

    s, h = 32760, 40
    q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dense = ms(lambda: fa3.flash_attn_func(q, k, v))
    print(f"dense FA3 {dense:.3f} ms")
    for sparsity in (0.0, 0.5, 0.8):
        for order in (None, torch.randperm(s)):
            layout = bs.SparseLayout(s, order)
            t = ms(lambda: runner(q, k, v, layout, sparsity))
            print(f"sparsity {sparsity} order {'perm' if order is not None else 'none'}: {t:.3f} ms "
                  f"-> {dense / t:.3f}x (plans {runner.plan_count})", flush=True)
    layout = bs.SparseLayout(s, None)
    kept = bs.kept_blocks(layout, 0.8)
    order, padded = runner._order(layout, q.device)
    g = h
    qt = q.permute(0, 2, 1, 3).index_select(2, order).view(g, s, 128)
    kt = k.permute(0, 2, 1, 3).index_select(2, padded).view(g, -1, 128)
    print("gather one tensor", ms(lambda: k.permute(0, 2, 1, 3).index_select(2, padded)))
    print("pool q+k", ms(lambda: (bs.pool_blocks(qt, s), bs.pool_blocks(kt, layout.full_key_blocks * 128))))
    pq, pk = bs.pool_blocks(qt, s), bs.pool_blocks(kt, layout.full_key_blocks * 128)
    print("select", ms(lambda: bs.select_blocks(pq, pk, layout, kept)))
    plan = runner._plan(g, layout, kept, 128, q.dtype, None, q.device)
    sel = bs.select_blocks(pq, pk, layout, kept)
    print("write indices", ms(lambda: runner._write_indices(plan, sel, layout, g)))
    vt = kt
    pages = layout.key_pages
    print("run only", ms(lambda: plan.wrapper.run(qt.reshape(g * s, 1, 128), (kt.view(g * pages, 128, 1, 128),
                                                                              vt.view(g * pages, 128, 1, 128)))))
    out = torch.empty_like(q)
    print("scatter out", ms(lambda: out.copy_(qt.view(1, g, s, 128).transpose(1, 2))))


def jit():
    start = time.perf_counter()
    q = torch.randn(1, 4096, 2, 128, device="cuda", dtype=torch.bfloat16)
    bs.BlockSparseRunner()(q, q, q, bs.SparseLayout(4096), 0.5)
    torch.cuda.synchronize()
    print(f"flashinfer paged fa3 bf16 d128 compiled/loaded in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    for job in sys.argv[1:]:
        globals()[job]()
