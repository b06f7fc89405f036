"""``benchmarks/distributed_offload_bench.py --smoke`` under torchrun with 2 gloo ranks: tiny models on the CPU,
checking that every rank's measurements reach rank 0's report (the multi-GPU numbers need H200s)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_smoke_two_gloo_ranks(tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "-m", "benchmarks.distributed_offload_bench",
               "--smoke", "--models", "flux,wan", "--out", str(out), "--ckpt-dir", str(tmp_path / "ckpt"),
               "--timeout", "60"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    report = json.loads(out.with_suffix(".json").read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert [b["rank"] for b in report["bandwidth"]] == [0, 1]
    assert [m["model"] for m in report["models"]] == ["flux", "wan"]
    for model in report["models"]:
        assert [r["rank"] for r in model["ranks"]] == [0, 1]
        for rank in model["ranks"]:
            rss = rank["allgather"]["rss"]
            assert set(rss) == {"before_load", "after_load", "after_enable"}
            assert all(rss[k]["anon"] > 0 and rss[k]["file"] > 0 for k in rss)
            # AllGather: each rank holds its half of the block bytes (ceil-padded shards)
            assert 0 <= 2 * rank["allgather"]["host_bytes"] - model["streamed_bytes"] < 4096
            assert rank["no_allgather"]["host_bytes"] == model["streamed_bytes"]
            assert rank["allgather"]["step_s"] > 0 and rank["no_allgather"]["step_s"] > 0
        assert all(model["steps"][k] > 0 for k in ("allgather", "no_allgather", "layerwise_1gpu", "resident_1gpu"))
        assert sum(b["count"] for b in model["blocks"]) == model["ranks"][0]["allgather"]["streamed_blocks"]
        assert all(b["gather_s"] > 0 and b["predicted_s"] > 0 for b in model["blocks"])
        targets = model["targets"]
        assert len(targets) == 3 and all(isinstance(t["meets"], bool) and t["limit"] > 0 for t in targets)
    markdown = out.with_suffix(".md").read_text()
    assert markdown.count("| Target | Measured | Limit | Rule | Meets |") == 2
