"""Distributed layerwise offload on CPU with gloo: 2-3 forked ranks per launch, every launch under a deadline."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from diffusers_omni import OffloadConfig
from diffusers_omni.offload.distributed import host_bytes_per_rank, shard_numel, shard_range
from diffusers_omni.offload.loading import CheckpointError, load_transformer_mmap, read_safetensors_header

import dist_harness
import dist_scenarios
from dist_harness import launch
from offload_helpers import bare_wan, file_mappings, flux_pipe, mapped_file, wan22_pipe

WORLD = 2

# Ranks fork from a fork server (see dist_harness): start it now, so that its imports overlap the tests before ours.
dist_harness.start_server()


def test_shard_math_pads_the_remainder():
    assert shard_numel(10, 4) == 3 and shard_range(10, 4, 3) == (9, 12)  # last shard: 1 real element + 2 padding
    assert shard_numel(12, 4) == 3 and shard_numel(0, 4) == 0 and shard_numel(1, 3) == 1
    assert [shard_range(7, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert host_bytes_per_rank({torch.bfloat16: 10, torch.float32: 3}, 4) == {torch.bfloat16: 6, torch.float32: 4}
    with pytest.raises(ValueError, match="world_size"):
        shard_numel(4, 0)


def test_config_rejects_combinations_before_anything_runs():
    for options, match in (
        ({"resident_layers": 2}, "resident_layers=2 needs full weights"),
        ({"tensor_parallel_size": 2}, "shard weights twice"),
        ({"hsdp": True}, "hsdp=True with use_allgather=True"),
        ({"prefetch_depth": 2}, "prefetch_depth=2 does not apply"),
    ):
        with pytest.raises(ValueError, match=match):
            OffloadConfig("distributed_layerwise", device="cpu", **options)
    OffloadConfig("distributed_layerwise", device="cpu", use_allgather=False, resident_layers=2, hsdp=True,
                  tensor_parallel_size=2)
    with pytest.raises(ValueError, match="use_allgather=False applies only to the distributed_layerwise strategy"):
        OffloadConfig("layerwise", device="cpu", use_allgather=False)


def test_enable_without_process_group_is_a_clear_error():
    pipe = flux_pipe()
    with pytest.raises(RuntimeError, match="torchrun"):
        pipe.enable_distributed_layerwise_offload(device="cpu")
    assert pipe.omni_offload_backend is None


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    transformer = wan22_pipe().transformer
    transformer.save_pretrained(single)
    transformer.save_pretrained(sharded, max_shard_size="30KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    results = launch(dist_scenarios.main_suite, WORLD, str(single), str(sharded), deadline=240)
    for rank, result in enumerate(results):
        assert result["ok"], "\n".join(dist_harness.describe(r, x) for r, x in enumerate(results))
    return [r["value"] for r in results]


def _scenario(suite, name):
    values = []
    for rank, per_rank in enumerate(suite):
        assert per_rank[name]["ok"], (rank, per_rank[name]["error"], per_rank[name]["tb"])
        values.append(per_rank[name]["value"])
    return values


@pytest.mark.parametrize("name", ["flux_allgather", "wan22_allgather"])
def test_allgather_is_bitwise_equal_with_two_slots_and_1_over_n_host_bytes(suite, name):
    for r in _scenario(suite, name):
        assert r["equal"] and r["ids_kept"] and r["equal_after_disable"] and r["restored"]
        assert r["materialised_between_calls"] and not any(r["materialised_between_calls"])
        assert r["slot_count"] == 2 and r["slot_bytes"] <= r["largest_block"]  # per slot: one (padded) block
        assert r["host_bytes_per_dtype"] == r["expected_host_bytes"]  # ceil(numel / N) per dtype
        assert r["host_bytes"] * WORLD - r["streamed_total"] < WORLD * 512 * 16
        assert r["on_demand_loads"] == 0


def test_progress_bars_on_rank_0_only_and_silenced_by_the_pipeline_config(suite):
    ranks = _scenario(suite, "progress")
    shown = ranks[0]["shown"]
    assert "packing shards" in shown["enable"] and "100%" in shown["enable"]
    last = shown["disable"].rstrip().split("\r")[-1]
    assert last.startswith("distributed offload: gathering blocks to host: 100%"), last
    for r in ranks[1:]:
        assert r["shown"] == {"enable": "", "disable": ""}
    for r in ranks:
        assert r["pipeline_disabled"] == {"enable": "", "disable": ""}


def test_odd_ring_streams_every_block_each_pass(suite):
    r = _scenario(suite, "flux_allgather")[0]
    # 7 blocks, 2 pipeline calls of 2 steps: block 0 primed once, then every block gathered once per forward.
    assert r["loads"] == 1 + 4 * 7


def test_no_allgather_with_resident_layers(suite):
    for r in _scenario(suite, "flux_no_allgather"):
        assert r["equal"] and r["equal_after_disable"]
        materialised = r["materialised_between_calls"]
        assert all(b > 0 for b in materialised[:2]) and not any(materialised[2:])
        assert r["host_bytes"] == sum(r["host_bytes_per_dtype"].values())


def test_gathered_weights_are_byte_identical(suite):
    for r in _scenario(suite, "dtypes"):
        assert r["byte_identical"] and r["restored_equal"]
        assert r["host_bytes_per_dtype"] == r["expected"]
        assert not any(r["empty_between"]) and r["on_demand_loads"] == 0


def test_three_ranks_remainder_padding_byte_identical():
    results = launch(dist_scenarios.dtypes_round_trip, 3, deadline=120)
    for rank, result in enumerate(results):
        assert result["ok"], dist_harness.describe(rank, result)
        value = result["value"]
        assert value["byte_identical"] and value["restored_equal"]
        assert value["host_bytes_per_dtype"] == value["expected"]


def test_data_parallel_requests_and_step_mismatch(suite):
    values = _scenario(suite, "data_parallel")
    for r in values:
        assert r["equal"], "each rank must get the single-process output for its own seed and prompt"
        assert "rank 0: 2, rank 1: 3" in r["mismatch"] and r["mismatch_s"] < 10
        assert r["equal_after"]
    assert values[0]["digest"] != values[1]["digest"]


def test_rejected_combinations_leave_the_pipeline_untouched(suite):
    for rank, r in enumerate(_scenario(suite, "rejections")):
        errors = r["errors"]
        assert all(message is not None for message in errors.values()), errors
        expected = "UnsupportedTensorError" if rank == 1 else "rank 1 could not enable"
        assert expected in errors["unstreamable on rank 1"] and "OpaqueTensor" in errors["unstreamable on rank 1"]
        assert r["unchanged"] and r["backend"]


def test_mmap_loading_single_and_sharded(suite):
    for r in _scenario(suite, "mmap"):
        for kind in ("single", "sharded"):
            got = r[kind]
            assert got["buffers_equal"] and got["nonpersistent"] == ["rope.freqs_cos", "rope.freqs_sin"]
            assert got["mapped_params"] > 0
            # Block weights are byte-exact; non-block weights stay views into the file, whose alignment may move
            # the last bit of CPU kernels (see diffusers_omni/testing/tiny.py), hence the tolerance.
            assert got["equal"] or got["max_diff"] < 1e-5, got
            assert got["host_bytes"] * WORLD >= got["streamed_total"]
            assert got["host_bytes"] * WORLD - got["streamed_total"] < WORLD * 512 * 16


def test_mmap_loading_equals_from_pretrained_and_adds_no_anonymous_memory(tmp_path):
    model = bare_wan()
    model.save_pretrained(tmp_path)
    reference = type(model).from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    loaded = load_transformer_mmap(type(model), tmp_path, torch_dtype=torch.bfloat16)
    ref = dict(list(reference.named_parameters()) + list(reference.named_buffers()))
    got = dict(list(loaded.named_parameters()) + list(loaded.named_buffers()))
    assert ref.keys() == got.keys()
    assert all(ref[k].dtype == got[k].dtype and torch.equal(ref[k], got[k]) for k in ref)
    same_dtype = load_transformer_mmap(type(model), tmp_path)
    mappings = file_mappings()
    files = {mapped_file(p, mappings) for p in same_dtype.parameters()}
    assert files == {str(tmp_path / "diffusion_pytorch_model.safetensors")}, "every parameter is a view of the file"


def test_corrupt_or_truncated_checkpoint_is_a_clear_error(tmp_path):
    model = bare_wan()
    model.save_pretrained(tmp_path)
    file = tmp_path / "diffusion_pytorch_model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_transformer_mmap(type(model), tmp_path)
    file.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="corrupt"):
        read_safetensors_header(file)
    file.write_bytes(b"\x01")
    with pytest.raises(CheckpointError, match="truncated"):
        load_transformer_mmap(type(model), tmp_path)


def test_ranks_do_not_inherit_the_test_process_garbage():
    """A destroyed gloo group still alive in cyclic garbage of the test process (a test dropped a pipeline with
    distributed offload on) must not reach the ranks. Ranks forked from the test process inherited it without its
    threads, and their garbage collector's ``~ProcessGroupGloo`` waited forever on thread handles reused by their
    own gloo threads: the intermittent hang of the full suite, made certain here by collecting in each rank."""
    gc.disable()  # the garbage must still exist when the ranks start
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        cycle = {"group": dist.group.WORLD}
        cycle["self"] = cycle
        dist.destroy_process_group()
        del cycle
        results = launch(dist_scenarios.collect_garbage, WORLD, deadline=60)
    finally:
        gc.enable()
        gc.collect()
    for rank, result in enumerate(results):
        assert result["ok"], dist_harness.describe(rank, result)
        assert result["value"] == {"barrier": True}


def test_a_rank_that_dies_ends_the_others_with_an_error():
    results = launch(dist_scenarios.rank_dies, WORLD, deadline=90, pg_timeout=20)
    assert results[1].get("exitcode") == 3
    assert results[0]["ok"], results[0]
    assert results[0]["value"]["error"] is not None and results[0]["value"]["seconds"] < 60


def test_generate_cli_under_torchrun(tmp_path):
    output = tmp_path / "out.png"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(dist_harness.free_port()), "-m", "diffusers_omni.cli.main", "generate",
        "--model", "tiny-flux", "--offload", "distributed-layerwise", "--steps", "2", "--height", "32", "--width",
        "32", "--rank-seeds", "3,4", "--output", str(output), "--per-rank-outputs",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out.rank0.png").exists() and (tmp_path / "out.rank1.png").exists()
    assert "seed 4" in done.stdout
