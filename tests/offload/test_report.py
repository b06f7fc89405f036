"""``pipe.omni_offload_report()``: where every component's weights are, under each strategy, on tiny pipelines."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from diffusers_omni.offload.report import LOCATIONS, OffloadReport

import dist_harness
import dist_scenarios
from dist_harness import launch
from offload_helpers import flux_pipe, generate, wan22_pipe

COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "vae")


def weight_bytes(module: nn.Module) -> int:
    """Parameter and buffer bytes, each tensor once (what the report must account for)."""
    tensors = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def block_bytes(pipe, *paths: str) -> int:
    return sum(weight_bytes(pipe.transformer.get_submodule(path)) for path in paths)


@pytest.fixture
def pipe():
    return flux_pipe()


def test_without_offload_every_weight_is_where_it_is_and_no_peak_before_a_call(pipe):
    expected = {name: weight_bytes(getattr(pipe, name)) for name in COMPONENTS}
    report = pipe.omni_offload_report()
    assert isinstance(report, OffloadReport) and report.strategy == "none" and report.host_memory_mode is None
    assert [c.component for c in report.components] == list(COMPONENTS)
    assert [c.kind for c in report.components] == ["transformer", "text encoder", "text encoder", "VAE"]
    for entry in report.components:
        assert entry.weight_bytes == expected[entry.component]
        # A CPU pipeline's weights are ordinary (pageable) host tensors, one copy each.
        assert entry.bytes == {"device": 0, "pinned": 0, "pageable": expected[entry.component], "disk": 0}
        assert entry.placement == "resident" and entry.device == "cpu"
    assert report.totals()["weight_bytes"] == sum(expected.values())
    assert report.peak_device_bytes is None and "has not been called" in report.peak_note

    generate(pipe, steps=1)
    report = pipe.omni_offload_report()
    assert report.peak_device_bytes is None
    assert "computes on cpu" in report.peak_note and "only for CUDA" in report.peak_note


def test_layerwise_streams_the_transformer_blocks_and_counts_each_copy(pipe):
    expected = {name: weight_bytes(getattr(pipe, name)) for name in COMPONENTS}
    # What streams: every block, the output layers folded into the last one (``fold_tail``).
    blocks = [f"transformer_blocks.{i}" for i in range(len(pipe.transformer.transformer_blocks))]
    blocks += [f"single_transformer_blocks.{i}" for i in range(len(pipe.transformer.single_transformer_blocks))]
    streamed = block_bytes(pipe, *blocks, "norm_out", "proj_out")
    first = block_bytes(pipe, blocks[0])
    backend = pipe.enable_layerwise_offload(device="cpu")
    generate(pipe, steps=2)
    report = pipe.omni_offload_report()
    assert report.strategy == "layerwise" and report.device == "cpu" and report.host_memory_mode == "pageable"
    transformer = report["transformer"]
    assert transformer.placement == "streamed" and transformer.weight_bytes == expected["transformer"]
    assert (transformer.streamed_blocks, transformer.resident_blocks) == (len(blocks), 0)
    encoders = {"text_encoder": pipe.text_encoder.text_model.encoder.layers
                if hasattr(pipe.text_encoder, "text_model") else pipe.text_encoder.encoder.layers,
                "text_encoder_2": pipe.text_encoder_2.encoder.block}
    assert sum(report[name].streamed_blocks for name in ("transformer", *encoders)) == backend.stats.streamed_blocks
    # Host copies of every streamed block; on the device only the non-block weights: the first block, loaded ahead
    # for the next step when the last block ended, left the device with the call's end.
    assert transformer.pageable_bytes == streamed
    assert transformer.device_bytes == expected["transformer"] - streamed
    # Encoders stream their blocks, their other weights on the device only while they run; the VAE only for its
    # phase: between calls every byte of theirs is a host copy.
    for name, layers in encoders.items():
        assert report[name].placement == "streamed" and report[name].streamed_blocks == len(layers)
        assert report[name].bytes == {"device": 0, "pinned": 0, "pageable": expected[name], "disk": 0}
    assert report["vae"].placement == "swapped"
    assert report["vae"].bytes == {"device": 0, "pinned": 0, "pageable": expected["vae"], "disk": 0}
    assert first > 0

    pipe.disable_omni_offload()
    after = pipe.omni_offload_report()
    assert after.strategy == "none"
    assert {c.component: c.bytes["pageable"] for c in after.components} == expected


def test_layerwise_budget_keeps_blocks_resident_with_their_host_copies():
    pipe = dist_scenarios.deep_flux_pipe()  # 3 + 4 blocks: room for resident and streamed ones
    total = weight_bytes(pipe.transformer)
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory=total - 1)
    transformer = pipe.omni_offload_report()["transformer"]
    stats = backend.stats
    assert stats.resident_blocks > 0 and stats.streamed_blocks > 0
    report = pipe.omni_offload_report()
    assert sum(c.streamed_blocks for c in report.components) == stats.streamed_blocks
    assert sum(c.resident_blocks for c in report.components) == stats.resident_blocks
    assert report["text_encoder_2"].streamed_blocks == len(pipe.text_encoder_2.encoder.block)  # DiT blocks first
    assert transformer.placement == "streamed" and transformer.weight_bytes == total
    # Every packed block keeps a host copy (resident ones too): host bytes are every block's.
    assert sum(c.pageable_bytes for c in report.components) == stats.host_bytes - _padding(backend)
    assert transformer.device_bytes + transformer.pageable_bytes > total


def _padding(backend) -> int:
    """Alignment padding of the packed host buffers (the report counts weights' bytes, not padding)."""
    units = [w for row in backend._state.weights for w in row] + [u.weights for u in backend._state.units]
    return sum(w.nbytes for w in units) - sum(s.numel * s.dtype.itemsize for w in units for s in w.slots)


def test_model_level_swaps_whole_components_and_the_running_one_has_a_device_copy(pipe):
    expected = {name: weight_bytes(getattr(pipe, name)) for name in COMPONENTS}
    pipe.enable_model_level_offload(device="cpu")
    report = pipe.omni_offload_report()
    for name in ("transformer", "text_encoder", "text_encoder_2"):
        assert report[name].placement == "swapped"
        assert report[name].bytes == {"device": 0, "pinned": 0, "pageable": expected[name], "disk": 0}
    assert report["vae"].placement == "resident" and report["vae"].device_bytes == expected["vae"]

    generate(pipe, steps=1)  # the transformer ran last: it is onloaded, its host copy kept
    report = pipe.omni_offload_report()
    assert report["transformer"].device_bytes == expected["transformer"]
    assert report["transformer"].pageable_bytes == expected["transformer"]
    assert report["text_encoder"].device_bytes == 0


def test_two_transformers_each_have_a_row():
    pipe = wan22_pipe()
    second = weight_bytes(pipe.transformer_2)
    pipe.enable_layerwise_offload(device="cpu")
    report = pipe.omni_offload_report()
    rows = {c.component: c for c in report.components}
    assert rows["transformer"].placement == rows["transformer_2"].placement == "streamed"
    assert rows["transformer_2"].weight_bytes == second
    assert rows["text_encoder"].kind == "text encoder" and rows["vae"].kind == "VAE"


def test_table_renders_every_component_and_the_totals(pipe):
    pipe.enable_layerwise_offload(device="cpu")
    generate(pipe, steps=1)
    text = str(pipe.omni_offload_report())
    lines = text.splitlines()
    assert lines[0] == "OmniFluxPipeline: offload layerwise on cpu, host copies pageable"
    header = next(line for line in lines if line.startswith("component"))
    for column in ("kind", "placement", "computes on", "weights", *LOCATIONS):
        assert column in header
    for name in COMPONENTS:
        assert any(line.startswith(name + " ") for line in lines), name
    assert any(line.startswith("total ") for line in lines)
    assert "streamed (2 blocks)" in text
    assert lines[-1].startswith("peak device memory of the last call: unknown (the pipeline computes on cpu")
    assert repr(pipe.omni_offload_report()) == text


def test_unknown_component_names_what_exists(pipe):
    with pytest.raises(KeyError, match="'unet' is not a component of this report; allowed: \\['transformer'"):
        pipe.omni_offload_report()["unet"]


def test_signature_of_the_call_is_the_diffusers_one(pipe):
    import inspect

    from diffusers import FluxPipeline

    assert inspect.signature(type(pipe).__call__) == inspect.signature(FluxPipeline.__call__)


def report_under_distributed(rank: int, world: int) -> dict:
    pipe = dist_scenarios.flux_pipe()
    # What streams in 1/N shards: the blocks (distributed offload keeps the output layers on the device).
    blocks = weight_bytes(pipe.transformer.transformer_blocks) + weight_bytes(pipe.transformer.single_transformer_blocks)
    pipe.enable_distributed_layerwise_offload(device="cpu")
    generate(pipe, steps=1)
    sharded = pipe.omni_offload_report()
    pipe.disable_omni_offload()
    pipe.enable_distributed_layerwise_offload(device="cpu", use_allgather=False)
    full = pipe.omni_offload_report()["transformer"].bytes
    pipe.disable_omni_offload()
    return {"sharded": sharded.to_dict(), "text": str(sharded), "weights": weight_bytes(pipe.transformer),
            "blocks": blocks, "full": full}


def test_distributed_allgather_host_bytes_are_each_ranks_shard():
    dist_harness.start_server()
    results = launch(report_under_distributed, 2)
    assert all(r["ok"] for r in results), results
    values = [r["value"] for r in results]
    rows = [{c["component"]: c for c in v["sharded"]["components"]} for v in values]
    assert values[0]["sharded"]["strategy"] == "distributed_layerwise"
    for row, value in zip(rows, values):
        assert row["transformer"]["placement"] == "streamed"
        assert row["transformer"]["weight_bytes"] == value["weights"]
        assert 0 < row["transformer"]["bytes"]["pageable"] < value["blocks"]
    # The two ranks' shards are the streamed blocks' weights, exactly once.
    assert sum(row["transformer"]["bytes"]["pageable"] for row in rows) == values[0]["blocks"]
    assert "this rank's 1/2 shards (rank 0)" in values[0]["text"]
    # Without AllGather every rank holds a full host copy of the blocks.
    assert [value["full"]["pageable"] for value in values] == [values[0]["blocks"]] * 2


def test_a_pipeline_whose_call_is_wrapped_again_still_records_its_call():
    """The PAG pipelines replace ``__call__`` after the mixin wrapped it; their calls are recorded all the same."""
    from diffusers import StableDiffusion3PAGPipeline

    from diffusers_omni import omnify
    from diffusers_omni.testing.tiny_sd3 import tiny_sd3_pipeline

    pipe = omnify(tiny_sd3_pipeline(pipeline_cls=StableDiffusion3PAGPipeline, pag_applied_layers=["blocks.1"]))
    assert "has not been called" in pipe.omni_offload_report().peak_note
    pipe(prompt="a cat", height=32, width=32, num_inference_steps=1, guidance_scale=1.0, pag_scale=3.0,
         output_type="latent")
    assert "computes on cpu" in pipe.omni_offload_report().peak_note


def test_encoder_blocks_streamed_through_the_plan_are_reported_under_their_encoder(pipe):
    from diffusers_omni.config.offload import OffloadPlan

    expected = {name: weight_bytes(getattr(pipe, name)) for name in ("text_encoder", "text_encoder_2")}
    t5_blocks = weight_bytes(pipe.text_encoder_2.encoder.block)
    plan = OffloadPlan(extra_streamed=("text_encoder_2.encoder.block",))
    pipe.enable_layerwise_offload(device="cpu", plan=plan, dits_only=True)  # the plan's streaming only
    report = pipe.omni_offload_report()
    t5 = report["text_encoder_2"]
    assert t5.placement == "streamed" and t5.streamed_blocks == len(pipe.text_encoder_2.encoder.block)
    assert t5.weight_bytes == expected["text_encoder_2"] and t5.pageable_bytes == t5_blocks
    assert report["text_encoder"].placement == "resident"
    assert report["text_encoder"].device_bytes == expected["text_encoder"]
