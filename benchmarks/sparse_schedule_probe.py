#!/usr/bin/env python
"""Does the paged kernel's work order cost the block-sparse call its L2 reuse? (H200 probe)

FlashInfer's SM90 prefill plan sorts the requests by KV length (``std::sort``, not stable) and deals them to one
persistent CTA per SM. Block-sparse requests (one per head and 128-row query block) all have the same KV length, so
the order the CTAs run them in is whatever the sort leaves: if neighbouring CTAs work on different heads, every page
they read comes from HBM rather than L2 (a head's K and V at Wan 480p are 16.7 MB; all heads 670 MB).

At the Wan 480p self shape this times the paged kernel of one selection planned (a) as one batch (what the runner
does), (b) as several batches of ``chunk`` heads each (planned separately, run one after another: the CTAs of a
batch only ever read that batch's heads), and (c) with every request's page ids in ascending order; each output is
compared bit for bit with (a). Dense FA3 is timed in the same process.

    python -m benchmarks run sparse-probe
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.common import time_ms
from diffusers_omni.attention.backends.rainfusion import block_sparse as bs


def chunked_runs(runner, call, chunk: int):
    """Wrappers planned for ``chunk`` heads each over the call's planned page table; returns a function running
    them all into one output."""
    plan, layout = call.plan, call.layout
    groups, s, d = call.qt.shape
    mb = layout.query_blocks
    kv_indptr = plan.kv_indptr  # host int32 [G·MB + 1]
    qo_indptr_all, last_len_all = runner._request_rows(groups, layout)
    parts = []
    for g0 in range(0, groups, chunk):
        g1 = min(groups, g0 + chunk)
        r0, r1 = g0 * mb, g1 * mb
        qo = (qo_indptr_all[r0:r1 + 1] - qo_indptr_all[r0]).to(torch.int32)
        kv = (kv_indptr[r0:r1 + 1] - kv_indptr[r0]).to(torch.int32)
        indices = plan.indices[int(kv_indptr[r0]):int(kv_indptr[r1])]
        wrapper = bs.flashinfer_paged_factory(call.qt.device)
        wrapper.plan(qo, kv, indices, last_len_all[r0:r1], 1, 1, d, bs.BLOCK, causal=False, sm_scale=call.scale,
                     q_data_type=call.qt.dtype, kv_data_type=call.qt.dtype, o_data_type=call.qt.dtype)
        parts.append((wrapper, g0, g1))
    out = torch.empty(groups * s, 1, d, device=call.qt.device, dtype=call.qt.dtype)
    q = call.qt.view(groups * s, 1, d)

    def run():
        for wrapper, g0, g1 in parts:
            wrapper.run(q[g0 * s:g1 * s], (call.k_pages, call.v_pages), out=out[g0 * s:g1 * s])
        return out

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json (the runner, python -m benchmarks run, chooses it)")
    args = parser.parse_args(argv)
    import fa3_fwd_interface

    device = "cuda"
    h, s, d = 40, 32760, 128
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    report = {"shape": {"H": h, "S": s, "D": d}, "rows": []}
    report["dense_fa3_ms"] = time_ms(lambda: fa3_fwd_interface.flash_attn_func(q, k, v), 5, 3)
    print(f"dense FA3 {report['dense_fa3_ms']:.3f} ms", flush=True)
    for sparsity in (0.5, 0.8):
        layout = bs.SparseLayout(s)
        runner = bs.BlockSparseRunner()
        call = runner.select(runner.prepare(q, k, v, layout, sparsity))
        runner.attend(call)
        base = call.out.clone()
        row = {"sparsity": sparsity, "one_batch_ms": time_ms(lambda: runner.attend(call), 5, 3)}
        for chunk in (1, 2, 4, 8, 20):
            run = chunked_runs(runner, call, chunk)
            equal = bool(torch.equal(run(), base))
            row[f"chunk_{chunk}_ms"] = time_ms(run, 5, 3)
            row[f"chunk_{chunk}_bitwise_equal"] = equal
            del run
        # Page ids of every request in ascending order (the planned schedule is the same).
        original = call.plan.indices.clone()
        lengths = call.plan.kv_indptr[1:] - call.plan.kv_indptr[:-1]
        width = int(lengths.max())
        if bool((lengths == width).all()):
            call.plan.indices.copy_(call.plan.indices.view(-1, width).sort(dim=1).values.view(-1))
            row["ascending_pages_ms"] = time_ms(lambda: runner.attend(call), 5, 3)
            runner.attend(call)
            row["ascending_pages_max_abs_diff"] = float((call.out.float() - base.float()).abs().max())
        else:  # dense prefix rows have other lengths: sort the sparse rows only
            sparse = call.plan.selected
            sparse.copy_(sparse.sort(dim=-1).values)
            row["ascending_pages_ms"] = time_ms(lambda: runner.attend(call), 5, 3)
        call.plan.indices.copy_(original)
        row["speedup_one_batch"] = report["dense_fa3_ms"] / row["one_batch_ms"]
        best = min((key for key in row if key.startswith("chunk_") and key.endswith("_ms")), key=row.get)
        row["best"] = best
        row["speedup_best"] = report["dense_fa3_ms"] / row[best]
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out + ".json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
