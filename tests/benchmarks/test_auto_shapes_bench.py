"""``benchmarks/auto_shapes_bench.py`` (#40's target: no out-of-memory error across shapes with
``max_device_memory="auto"``): the pipeline-offload-flux-shapes scenario's arguments run with ``--smoke`` on the tiny
CPU pipeline (one row per shape, none out of memory, auto's reading and choice recorded, the table written); the
``--shapes`` parser and its refusals; an out-of-memory call counted and the run going on; the summary's card check."""

import dataclasses
import json

import pytest
import torch

from benchmarks import auto_shapes_bench as bench
from benchmarks import registry
from benchmarks.pipeline_offload_bench import PhaseClock


def test_shapes_parse_in_order_with_repeats():
    shapes = bench.parse_shapes(" 1024x1, 512X2,2048×2,1024x1 ")
    assert [(s.size, s.batch) for s in shapes] == [(1024, 1), (512, 2), (2048, 2), (1024, 1)]
    assert [s.label for s in shapes] == ["1024x1", "512x2", "2048x2", "1024x1"]
    default = bench.parse_shapes(bench.DEFAULT_SHAPES)
    assert {s.size for s in default} == {512, 1024, 1536, 2048} and {s.batch for s in default} == {1, 2}
    directions = [bench.direction(s, p) for s, p in zip(default, [None, *default])]
    assert directions[0] == "first" and "grows" in directions and "shrinks" in directions
    assert bench.run_size(default[0], smoke=True) == 1024 // bench.SMOKE_DIVISOR == 64


@pytest.mark.parametrize("bad, says", [
    ("1024", "'1024' is not SIZExBATCH"),
    ("1024x1,big", "'big' is not SIZExBATCH"),
    ("1000x1", "size 1000 is not a multiple of 64"),
    ("8192x1", "size 8192 is not a multiple of 64 from 64 to 4096"),
    ("1024x0", "batch 0 is not from 1 to 8"),
    ("1024x9", "batch 9 is not from 1 to 8"),
    (" , ", "no shape given"),
])
def test_bad_shapes_are_refused_naming_the_option_the_value_and_what_is_allowed(bad, says):
    with pytest.raises(ValueError) as error:
        bench.parse_shapes(bad)
    message = str(error.value)
    assert message.startswith("--shapes: ") and says in message
    assert "allowed: comma-separated SIZExBATCH items" in message and "multiple of 64 from 64 to 4096" in message


def test_the_command_line_refuses_bad_shapes_with_the_same_message(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--shapes", "1024x1,2048x3x1", "--out", "x"])
    err = capsys.readouterr().err
    assert "--shapes: '2048x3x1' is not SIZExBATCH" in err and "allowed: " in err


def test_the_scenario_runs_the_default_shapes_on_a_12_gib_card():
    scenario = registry.get("pipeline-offload-flux-shapes")
    assert scenario.script == "auto_shapes_bench" and scenario.device == "gpu" and scenario.smoke == ("--smoke",)
    args = bench.parse_args([*scenario.args, *scenario.smoke, "--out", "unused"])
    assert (args.model, args.card_gib, args.shapes) == ("flux", 12.0, bench.DEFAULT_SHAPES)
    assert args.time_budget == 450 and args.steps == 2  # the smoke's steps; the scenario's own: 4
    assert scenario.args[scenario.args.index("--steps") + 1] == "4"
    assert args.omni_runs == {"omni-auto": {"budget": "auto", "compression": None}}


def test_smoke_runs_every_shape_with_the_auto_budget_and_writes_the_table(tmp_path):
    scenario = registry.get("pipeline-offload-flux-shapes")
    out = tmp_path / "run"
    assert bench.main([*scenario.args, *scenario.smoke, "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    shapes = bench.DEFAULT_SHAPES.split(",")
    assert report["status"] == "ok" and report["shapes"] == shapes
    calls = report["calls"]
    auto = report["auto"]
    blocks = auto["resident_blocks"] + auto["streamed_blocks"]
    assert [c["shape"] for c in calls] == shapes and [c["index"] for c in calls] == list(range(len(shapes)))
    assert all(c["status"] == "ok" and c["oom"] is False and c["error"] is None for c in calls), calls
    for call in calls:  # each call ran at its (scaled) shape: batch × side × side images
        side = call["size"] // bench.SMOKE_DIVISOR
        assert (call["height"], call["width"]) == (side, side)
        assert call["image"]["shape"] == [call["batch"], side, side, 3] and call["image"]["nan_fraction"] == 0
        assert call["forwards"] == {"transformer": report["steps"]} and call["seconds"] > 0
        assert call["peak_allocated"] is None and call["within_card"] is None  # the CPU: no device peak, no card
        stats = call["stats"]
        # Re-planning per shape may move blocks between resident and streamed; the blocks stay the same.
        assert stats["resident_blocks"] + stats["streamed_blocks"] == blocks
        assert {"resident_device_bytes", "auto"} <= set(stats) and call["events"] == []
        assert "store_counters" not in stats  # the large per-store fields are left out
        if stats["streamed_blocks"]:
            assert call["stats_delta"]["loads"] > 0  # streamed blocks were loaded during the call
    assert [c["direction"] for c in calls][:4] == ["first", "shrinks", "grows", "grows"]
    # Auto's reading and choice, made once at enable, on the smoke's fake card: part resident, part streamed.
    assert auto["budget"] == "auto" and auto["max_device_memory"] == "auto"
    assert auto["auto"][0].startswith("max_device_memory=auto: ") and auto["auto_readings"]["device"] == "cpu"
    assert 0 < auto["planned_budget_bytes"] < report["weight_bytes"]
    assert auto["resident_blocks"] >= 1 and auto["streamed_blocks"] >= 1
    summary = report["summary"]
    assert (summary["calls"], summary["ran"], summary["ok"], summary["oom"], summary["errors"]) == (10, 10, 10, 0, 0)
    assert summary["card_bytes"] is None and summary["target_met"] is None  # no card check on the CPU
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["diffusers"]
    text = out.with_suffix(".md").read_text()
    assert text.startswith("# Automatic device budget across shapes: FluxPipeline (flux)")
    assert "torch " + torch.__version__ in text and "auto chose " in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert len(rows) == len(shapes)
    assert rows[0].startswith("| 1 | 1024² ×1 (run at 64²) |") and "| 4 | 2048² ×1 (run at 128²), grows |" in text
    assert all("| no |" in row and "n/a (CPU)" in row for row in rows)
    assert "**0 of 10 calls ran out of memory**" in text
    # The fake reading is gone once the run is over (the test's process reads the machine again).
    from diffusers_omni.offload import budget

    assert budget.read_machine(torch.device("cpu")).mem_available != report["smoke_card_bytes"]


@dataclasses.dataclass
class _Stats:
    resident_blocks: int = 3
    streamed_blocks: int = 4
    resident_device_bytes: int = 300
    residents_shrunk: int = 0
    residents_shrunk_bytes: int = 0
    tiled_vaes: list = dataclasses.field(default_factory=list)
    auto: list = dataclasses.field(default_factory=lambda: ["max_device_memory=auto: 1 GiB"])
    headroom: dict = dataclasses.field(default_factory=dict)
    headroom_kept: int = 0
    store_counters: dict = dataclasses.field(default_factory=lambda: {"pinned": {"transformer": {"loads": 1}}})


class _Backend:
    def __init__(self):
        self.stats = _Stats()


def test_an_out_of_memory_call_is_counted_and_the_next_shape_runs():
    backend = _Backend()
    called = []

    def target(height, width, num_images_per_prompt, generator):
        called.append((height, num_images_per_prompt))
        if num_images_per_prompt == 2:
            backend.stats.residents_shrunk += 2
            backend.stats.residents_shrunk_bytes += 2 * 2**30
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        backend.stats.headroom[f"{height}x{num_images_per_prompt}"] = 1000 * height
        backend.stats.headroom_kept += 1
        backend.stats.tiled_vaes.append("vae")

        class Output:
            images = torch.zeros(num_images_per_prompt, height, width, 3).numpy()
        return Output()

    def make_kwargs(shape):
        return {"height": shape.size // 16, "width": shape.size // 16, "num_images_per_prompt": shape.batch}

    shapes = bench.parse_shapes("1024x1,2048x2,512x1")
    rows = []
    bench.run_calls(shapes, target, backend, make_kwargs, PhaseClock(torch.device("cpu")), torch.device("cpu"), None,
                    4, lambda: None, 30.0, rows.append)
    assert called == [(64, 1), (128, 2), (32, 1)]  # the run went on after the failure
    assert [r["status"] for r in rows] == ["ok", "oom", "ok"] and [r["oom"] for r in rows] == [False, True, False]
    assert rows[1]["error"]["type"] == "OutOfMemoryError" and rows[1]["error"]["stage"] == "encode"
    assert rows[1]["events"] == ["2 resident blocks stream since a step ran out of memory (2.00 GiB)"]
    assert rows[0]["events"] == ["vae switched to tiling after running out of memory (its image may differ)"]
    # Re-planning counters read generically: as they stand, and what the call changed.
    assert rows[2]["replanning"] == {"headroom": {"64x1": 64000, "32x1": 32000}, "headroom_kept": 2}
    assert rows[2]["replanning_delta"] == {"headroom": {"32x1": 32000}, "headroom_kept": 1}
    assert "store_counters" not in rows[0]["stats"] and rows[0]["stats"]["resident_blocks"] == 3
    summary = bench.summary(rows, None)
    assert (summary["oom"], summary["ok"], summary["oom_shapes"]) == (1, 2, ["2048x2"])


def test_a_call_is_not_started_without_enough_time_budget_left():
    rows = []
    bench.run_calls(bench.parse_shapes("512x1,1024x1"), None, _Backend(), None, PhaseClock(torch.device("cpu")),
                    torch.device("cpu"), None, 4, lambda: 10.0, 30.0, rows.append)
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert rows[0]["skip_reason"] == "time budget: 10 s left (a call needs 30 s)"
    assert bench.summary(rows, None)["skipped"] == 2


def test_summary_checks_every_peak_against_the_card():
    card = 12 * 2**30

    def row(shape, reserved, oom=False):
        return {"shape": shape, "status": "oom" if oom else "ok", "oom": oom, "peak_allocated": reserved - 2**30,
                "peak_reserved": reserved, "within_card": reserved <= card, "events": []}

    met = bench.summary([row("512x1", 8 * 2**30), row("2048x2", 11 * 2**30)], card)
    assert met["all_within_card"] is True and met["target_met"] is True
    assert met["largest_peak_reserved"] == 11 * 2**30 and met["largest_peak_share_of_card"] == pytest.approx(11 / 12)
    over = bench.summary([row("512x1", 8 * 2**30), row("2048x2", 13 * 2**30)], card)
    assert over["over_card_shapes"] == ["2048x2"] and over["target_met"] is False
    oom = bench.summary([row("512x1", 8 * 2**30), row("2048x2", 11 * 2**30, oom=True)], card)
    assert oom["all_within_card"] is True and oom["target_met"] is False and oom["oom_shapes"] == ["2048x2"]


def test_the_table_of_a_device_run_shows_peaks_against_the_card_and_the_failures():
    """The rendering a GPU run gets (the CPU smoke has no peaks, no card): hand-made calls of a 12 GiB card."""
    card = 12 * 2**30
    base = {"status": "ok", "oom": False, "error": None, "seconds": 12.5, "events": [], "replanning_delta": {},
            "stats": {"resident_blocks": 20, "streamed_blocks": 37}}
    calls = [
        {**base, "index": 0, "shape": "1024x1", "size": 1024, "batch": 1, "height": 1024, "direction": "first",
         "peak_allocated": 9 * 2**30, "peak_reserved": 10 * 2**30, "within_card": True},
        {**base, "index": 1, "shape": "2048x2", "size": 2048, "batch": 2, "height": 2048, "direction": "grows",
         "status": "oom", "oom": True, "peak_allocated": 11 * 2**30, "peak_reserved": 12 * 2**30, "within_card": True,
         "error": {"stage": "decode", "type": "OutOfMemoryError", "message": "CUDA out of memory | 2 GiB"},
         "events": ["vae switched to tiling after running out of memory (its image may differ)"],
         "replanning_delta": {"headroom_streamed": 3, "headroom": {"2048x2": 3 * 2**30}}},
        {"index": 2, "shape": "512x1", "size": 512, "batch": 1, "direction": "shrinks", "status": "skipped",
         "oom": False, "error": None, "skip_reason": "time budget: 10 s left (a call needs 30 s)"},
    ]
    report = {"environment": {"device_name": "NVIDIA H200", "torch": "2.13.0", "diffusers": "0.42.1"},
              "args": {"smoke": False, "card_gib": 12.0, "model": "flux"}, "pipeline": "FluxPipeline", "steps": 4,
              "calls": calls, "summary": bench.summary(calls, card), "notes": ["a note"],
              "auto": {"planned_budget_bytes": 8 * 2**30, "auto": ["max_device_memory=auto: 8.00 GiB (...)"],
                       "auto_readings": {"device": "cuda:0"}, "resident_blocks": 20, "streamed_blocks": 37}}
    text = bench.markdown(report)
    assert "NVIDIA H200, torch 2.13.0, diffusers 0.42.1; 12 GiB card emulated" in text
    assert "auto chose 8.00 GiB at enable; blocks resident / streamed 20 / 37." in text
    assert "| 1 | 1024² ×1 | 12.5 s | 9.00 GiB / 10.00 GiB | yes | no | 20 / 37 |  |" in text
    assert ("| 2 | 2048² ×2, grows | 12.5 s | 11.00 GiB / 12.00 GiB | yes | **OOM** | 20 / 37 | OutOfMemoryError "
            "in decode: CUDA out of memory / 2 GiB; vae switched to tiling") in text
    assert ("auto measured beside the resident weights: 2048x2 3.00 GiB; auto kept 0 streamed blocks on the device "
            "(0.00 GiB) and streamed 3 resident ones first (0.00 GiB) |") in text
    assert "| 3 | 512² ×1, shrinks | skipped | | | | | time budget: 10 s left (a call needs 30 s) |" in text
    assert ("**1 of 2 calls ran out of memory**, 1 skipped (time budget); largest peak 11.00 GiB allocated / 12.00 "
            "GiB reserved against the 12.00 GiB card (100 %); every call within the card. #40's target: NOT met."
            ) in text
