#!/usr/bin/env python
"""Automatic device budget across shapes (#40): one pipeline, one ``max_device_memory="auto"``, calls of growing and
shrinking size on an emulated card; every call's peak against the card and every out-of-memory error counted.

The target it measures (issue #40): "No out-of-memory error across 512² … 2048² and batch 1–2 on the 12 GiB card;
every call's peak ≤ the card", FLUX.1-dev with ``enable_layerwise_offload(max_device_memory="auto")``.

One process: the card cap (``torch.cuda.set_per_process_memory_fraction(card_gib · 2³⁰ / total device memory)``, set
before enabling, as ``benchmarks/pipeline_offload_bench.py`` emulates a card), the full-size pipeline built as that
benchmark builds it (the real configs, bf16 random weights, tokenizers built locally: ``build_pipeline``), omni
enabled once with ``max_device_memory="auto"`` (``enable_strategy``'s ``omni-auto``: the budget read from the device
after the cap is set; what auto read and chose is recorded, ``omni_plan``), then one call per shape of ``--shapes``
(``SIZExBATCH``: a square image of SIZE² pixels, ``num_images_per_prompt=BATCH``), in that order. The default goes
up, down and up again and ends small (1024, 512, 1536, 2048 at batch 1, then 512 … 2048 at batch 2, then 1024 and
512 at batch 1), so that the shape both grows and shrinks between calls. Few steps per call (``--steps``, 4): this
measures memory, not speed.

Per call: seconds (and encode / denoise / decode from synchronised transformer forward hooks), the device peak
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, the peak reset before the call), whether that peak
stayed within the card (``--card-gib`` GiB; reserved, the larger of the two, is what is checked), whether the call
raised ``torch.OutOfMemoryError`` (caught and counted: the run goes on with the next shape; any other exception is
recorded likewise), the offload's stats after the call (``dataclasses.asdict(backend.stats)``: its scalar fields,
``auto``, ``tiled_vaes`` and auto's per-shape headroom, ``headroom*``: what each shape measured and the blocks it
kept on the device or streamed first, ``headroom_notes``) and what the offload did during that call when memory ran
out (``memory_events`` of the change in its counters over the call: residents left for the VAE, residents streamed after
a step's retry, window shrunk, VAE tiled). ``--time-budget``: no call starts once the budget, less ``--min-left``, is
spent (the calls left are recorded as skipped). ``<out>.json`` holds the environment, the arguments, auto's plan,
every call and a summary; ``<out>.md`` a table (one row per call) and the summary line (calls that ran out of
memory, the largest peak against the card).

Usage::

    python -m benchmarks run pipeline-offload-flux-shapes            # on the H200
    python -m benchmarks run pipeline-offload-flux-shapes --smoke    # tiny FLUX pipeline on the CPU
    python -m benchmarks.auto_shapes_bench --model flux --card-gib 12 --steps 4 --shapes 1024x1,2048x2 --out /tmp/s

``--smoke`` runs the same code path on the CPU with the tiny FLUX pipeline (``device="cpu"``), every size divided by
``SMOKE_DIVISOR`` (512 … 2048 → 32 … 128 px), at most 2 steps. There auto reads host memory (the CPU is the device);
that reading is replaced by a small fake one (``smoke_card``) so that auto keeps part of the tiny DiT resident and
streams the rest, as on the card. The CPU has no device peak, so the card check is not made there (n/a).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.offload_bench import environment, host_rss
from benchmarks.pipeline_offload_bench import (
    AUTO, GiB, MODELS, SEED, PhaseClock, _error, _gib, _s, _size, build_pipeline, call_kwargs, enable_strategy,
    fingerprint, headroom_notes, least_device_budget, memory_events, omni_plan, omni_runs,
)

STRATEGY = "omni-auto"  # pipeline_offload_bench's name for max_device_memory="auto"
DEFAULT_SHAPES = "1024x1,512x1,1536x1,2048x1,512x2,1024x2,1536x2,2048x2,1024x1,512x1"
# A size must be a multiple of this: FLUX packs 2×2 latents of an 8× VAE (16), and the smoke run's sizes (÷ 16) must
# still suit the tiny pipeline (a 2× VAE, 2×2 packing: 4).
SIZE_MULTIPLE = 64
SIZE_RANGE = (64, 4096)
MAX_BATCH = 8
SMOKE_DIVISOR = 16
SMOKE_STEPS = 2
# Stats kept per call besides the scalar fields: lists of what happened, and auto's per-shape headroom
# (``diffusers_omni/offload/headroom.py``: what each shape measured, the blocks it kept on the device or streamed).
KEEP_STATS = ("auto", "tiled_vaes")
REPLAN_PREFIXES = ("headroom",)
MODELS_HERE = ("flux",)  # the image pipeline #40's target names (num_images_per_prompt)


# Shapes ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    size: int  # pixels on a side (square), as given
    batch: int  # num_images_per_prompt

    @property
    def label(self) -> str:
        return f"{self.size}x{self.batch}"

    @property
    def pixels(self) -> int:
        return self.size * self.size * self.batch


def parse_shapes(text: str, option: str = "--shapes") -> list[Shape]:
    """``--shapes``: comma-separated ``SIZExBATCH`` items (``1024x1,2048x2``), run in that order (repeats allowed: the
    same shape again after others). ``ValueError`` naming the option, the item and what is allowed otherwise."""
    allowed = (f"allowed: comma-separated SIZExBATCH items (e.g. 1024x1,2048x2), SIZE the side of a square image in "
               f"pixels, a multiple of {SIZE_MULTIPLE} from {SIZE_RANGE[0]} to {SIZE_RANGE[1]}, BATCH images per "
               f"prompt from 1 to {MAX_BATCH}")
    shapes = []
    for item in (part.strip() for part in (text or "").split(",")):
        if not item:
            continue
        found = re.fullmatch(r"(\d+)\s*[xX×]\s*(\d+)", item)
        if not found:
            raise ValueError(f"{option}: {item!r} is not SIZExBATCH; {allowed}")
        size, batch = int(found.group(1)), int(found.group(2))
        if not SIZE_RANGE[0] <= size <= SIZE_RANGE[1] or size % SIZE_MULTIPLE:
            raise ValueError(f"{option}: {item!r}: size {size} is not a multiple of {SIZE_MULTIPLE} from "
                             f"{SIZE_RANGE[0]} to {SIZE_RANGE[1]}; {allowed}")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"{option}: {item!r}: batch {batch} is not from 1 to {MAX_BATCH}; {allowed}")
        shapes.append(Shape(size, batch))
    if not shapes:
        raise ValueError(f"{option}: no shape given in {text!r}; {allowed}")
    return shapes


def run_size(shape: Shape, smoke: bool) -> int:
    """The side the call runs at: as given, or ÷ ``SMOKE_DIVISOR`` on the tiny pipeline."""
    return shape.size // SMOKE_DIVISOR if smoke else shape.size


def direction(shape: Shape, previous: Shape | None) -> str:
    """How the call's size (pixels × batch) changed from the previous call's: first, grows, shrinks, same."""
    if previous is None:
        return "first"
    if shape.pixels == previous.pixels:
        return "same"
    return "grows" if shape.pixels > previous.pixels else "shrinks"


# The offload's stats --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def smoke_card(device_budget: int) -> Iterator[int]:
    """``--smoke``: on the CPU, auto reads host memory (gigabytes: every tiny block would stay resident and nothing
    would stream). While open, ``budget.read_machine`` reports a ``MemAvailable`` (and no cgroup limit) that leaves
    auto ``device_budget`` bytes after its headroom (``HEADROOM_MIN`` below 5 GiB). Yields the size reported."""
    from diffusers_omni.offload import budget

    fake = budget.HEADROOM_MIN + device_budget
    original = budget.read_machine

    def read(device: torch.device) -> Any:
        reading = original(device)
        if reading.device != "cpu":
            return reading
        return dataclasses.replace(reading, mem_available=fake, cgroup_limit=None, cgroup_usage=None)

    budget.read_machine = read
    try:
        yield fake
    finally:
        budget.read_machine = original


def stats_dict(backend: Any) -> dict[str, Any]:
    """The offload's stats (``LayerwiseStats``) as a dict, whatever fields it has now; empty without stats."""
    stats = getattr(backend, "stats", None)
    if stats is None:
        return {}
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(vars(stats))


def _replanning(key: str) -> bool:
    return key.startswith(REPLAN_PREFIXES)


def call_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """What a call keeps of the stats: every scalar field (blocks resident and streamed, resident bytes, the event
    counters ...), ``KEEP_STATS`` and every re-planning key whatever its type; not the per-store dicts (large)."""
    return {k: v for k, v in stats.items()
            if k in KEEP_STATS or _replanning(k) or v is None or isinstance(v, (bool, int, float, str))}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What changed over one call: numeric fields as differences, lists as what was appended, dicts as the entries
    added or changed, anything else as its new value; fields that did not change are left out."""
    delta: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if value == old:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(old, (int, float)):
            delta[key] = value - old
        elif isinstance(value, list) and isinstance(old, list):
            delta[key] = value[len(old):] if value[:len(old)] == old else value
        elif isinstance(value, dict) and isinstance(old, dict):
            delta[key] = {k: v for k, v in value.items() if k not in old or old[k] != v}
        else:
            delta[key] = value
    return delta


def replanning(stats: dict[str, Any]) -> dict[str, Any]:
    """The per-shape re-planning keys of ``stats`` (none until the offload has such counters)."""
    return {k: v for k, v in stats.items() if _replanning(k)}


# The calls ------------------------------------------------------------------------------------------------------------


def is_out_of_memory(error: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or an error that says it ran out of device memory (cuBLAS/cuDNN workspaces)."""
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    text = str(error).lower()
    return isinstance(error, oom) or "out of memory" in text or "alloc_failed" in text


def failed_phase(clock: PhaseClock, steps: int) -> str:
    """Where a failed call stopped: encode (no transformer forward yet), denoise (fewer forwards than steps: a
    guidance-distilled model runs one per step), decode."""
    done = sum(clock.forwards.values())
    if clock.first is None:
        return "encode"
    return "denoise" if done < steps else "decode"


def run_call(index: int, shape: Shape, previous: Shape | None, target: Callable[..., Any], backend: Any,
             kwargs: dict[str, Any], clock: PhaseClock, device: torch.device, card_bytes: int | None,
             steps: int) -> dict[str, Any]:
    """One call at ``shape``: its time and phases, device peak against the card, out of memory or not, and the
    offload's stats after it (with what changed over it)."""
    side = kwargs["height"]
    row: dict[str, Any] = {"index": index, "shape": shape.label, "size": shape.size, "batch": shape.batch,
                           "height": side, "width": kwargs["width"], "direction": direction(shape, previous),
                           "status": "running", "oom": False, "error": None}
    before = stats_dict(backend)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        row["allocated_before"] = torch.cuda.memory_allocated(device)
        row["reserved_before"] = torch.cuda.memory_reserved(device)
    generator = torch.Generator("cpu").manual_seed(SEED)
    clock.begin()
    try:
        output = target(**kwargs, generator=generator)
        clock.end()
        row["status"] = "ok"
        row["image"] = {k: v for k, v in fingerprint(output).items() if k in ("shape", "nan_fraction", "sha256")}
        del output
    except Exception as error:  # noqa: BLE001 - the point is to count failures: record, go on with the next shape
        try:
            clock.end()
        except Exception:  # noqa: BLE001 - a broken context cannot synchronise: the time is the host's
            clock.t1 = time.perf_counter()
        row["oom"] = is_out_of_memory(error)
        row["status"] = "oom" if row["oom"] else "error"
        row["error"] = {**_error(failed_phase(clock, steps), error), "traceback_tail": traceback.format_exc(
            limit=-3).strip().splitlines()[-6:]}
        del error
    gc.collect()
    row["seconds"] = clock.t1 - clock.t0
    row["phases"] = clock.phases()
    row["forwards"] = dict(clock.forwards)
    if device.type == "cuda":
        row["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        row["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        row["within_card"] = None if card_bytes is None else (
            max(row["peak_allocated"], row["peak_reserved"]) <= card_bytes)
    else:
        row["peak_allocated"] = row["peak_reserved"] = row["within_card"] = None  # no device peak on the CPU
    row["host_rss"] = host_rss()["rss"]
    after = stats_dict(backend)
    delta = stats_delta(before, after)
    if "residents_left" in delta:  # the bytes of the last departure, not a running sum: shown as they are
        delta["residents_left_bytes"] = after.get("residents_left_bytes") or 0
    row["stats"] = call_stats(after)
    row["stats_delta"] = call_stats(delta)
    row["events"] = memory_events(delta)
    row["replanning"] = replanning(after)  # as they stand after the call
    row["replanning_delta"] = replanning(delta)  # what this call changed of them
    return row


def run_calls(shapes: list[Shape], target: Callable[..., Any], backend: Any, make_kwargs: Callable[[Shape], dict],
              clock: PhaseClock, device: torch.device, card_bytes: int | None, steps: int,
              left: Callable[[], float | None], min_left: float,
              record: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Every shape in order, one call each (``run_call``); a call does not start with less than ``min_left``
    seconds of the time budget left (``left()``: None, no budget): it and the ones after are recorded as skipped.
    ``record`` sees each row as it is made (the report is written after each)."""
    rows: list[dict[str, Any]] = []
    previous = None
    for index, shape in enumerate(shapes):
        remaining = left()
        if remaining is not None and remaining < min_left:
            row = {"index": index, "shape": shape.label, "size": shape.size, "batch": shape.batch,
                   "direction": direction(shape, previous), "status": "skipped", "oom": False, "error": None,
                   "skip_reason": f"time budget: {max(remaining, 0):.0f} s left (a call needs {min_left:.0f} s)"}
        else:
            kwargs = make_kwargs(shape)
            print(f"[{index + 1}/{len(shapes)}] {shape.label}: {kwargs['height']}×{kwargs['width']}, batch "
                  f"{shape.batch}, {steps} steps", flush=True)
            row = run_call(index, shape, previous, target, backend, kwargs, clock, device, card_bytes, steps)
            peak = "" if row["peak_reserved"] is None else (
                f", peak {_gib(row['peak_allocated'])} allocated / {_gib(row['peak_reserved'])} reserved")
            what = "ok" if row["status"] == "ok" else f"{row['error']['type']} in {row['error']['stage']}"
            print(f"    {what} in {_s(row['seconds'])}{peak}" + "".join(f"; {e}" for e in row["events"]), flush=True)
            previous = shape
        rows.append(row)
        record(row)
    return rows


def summary(calls: list[dict[str, Any]], card_bytes: int | None) -> dict[str, Any]:
    """How many calls ran, ran out of memory, failed otherwise or were skipped; the largest peaks against the card;
    and whether #40's target holds (no out-of-memory error, every call ran and stayed within the card: None where
    there is no card to check, the CPU)."""
    ran = [c for c in calls if c["status"] != "skipped"]
    peaks_a = [c["peak_allocated"] for c in ran if c.get("peak_allocated") is not None]
    peaks_r = [c["peak_reserved"] for c in ran if c.get("peak_reserved") is not None]
    largest = max(peaks_a + peaks_r, default=None)
    out = {
        "calls": len(calls), "ran": len(ran), "ok": sum(c["status"] == "ok" for c in calls),
        "oom": sum(bool(c["oom"]) for c in calls), "errors": sum(c["status"] == "error" for c in calls),
        "skipped": len(calls) - len(ran),
        "oom_shapes": [c["shape"] for c in calls if c["oom"]],
        "over_card_shapes": [c["shape"] for c in ran if c.get("within_card") is False],
        "largest_peak_allocated": max(peaks_a, default=None), "largest_peak_reserved": max(peaks_r, default=None),
        "card_bytes": card_bytes,
        "largest_peak_share_of_card": largest / card_bytes if largest is not None and card_bytes else None,
        "calls_with_memory_events": sum(bool(c.get("events")) for c in ran),
    }
    checked = card_bytes is not None and len(peaks_r) == len(ran)
    out["all_within_card"] = None if not checked else not out["over_card_shapes"]
    out["target_met"] = None if not checked else (
        out["oom"] == 0 and out["errors"] == 0 and out["skipped"] == 0 and out["all_within_card"])
    return out


# Report ---------------------------------------------------------------------------------------------------------------


def _card_cell(call: dict[str, Any]) -> str:
    within = call.get("within_card")
    return "n/a" if within is None else "yes" if within else "**NO**"


def _shape_cell(call: dict[str, Any], smoke: bool) -> str:
    text = f"{call['size']}² ×{call['batch']}"
    if smoke and call.get("height"):
        text += f" (run at {call['height']}²)"
    return text + ("" if call["direction"] in ("first", "same") else f", {call['direction']}")


def markdown(report: dict[str, Any]) -> str:
    env = report.get("environment") or {}
    args = report["args"]
    smoke = args["smoke"]
    card = (f"no card (CPU smoke run: tiny pipeline, sizes ÷ {SMOKE_DIVISOR}, no device peak)" if smoke else
            f"{args['card_gib']:g} GiB card emulated (set_per_process_memory_fraction before enabling)")
    weights = "tiny configs (smoke)" if smoke else "bf16 random weights at the real sizes"
    plan = report.get("auto") or {}
    chosen = plan.get("planned_budget_bytes")
    lines = [
        f"# Automatic device budget across shapes: {report['pipeline']} ({args['model']})",
        "",
        f"{env.get('device_name', 'unknown device')}, torch {env.get('torch', '?')}, diffusers "
        f"{env.get('diffusers', '?')}; {card}; one `enable_layerwise_offload(max_device_memory=\"auto\")`, then "
        f"{len(report['calls'])} calls of {report['steps']} steps each, in the order below (seed {SEED}, {weights}).",
        "",
    ]
    if chosen is not None or plan.get("auto"):
        lines.append(f"auto chose {_size(chosen)} at enable; blocks resident / streamed "
                     f"{plan.get('resident_blocks')} / {plan.get('streamed_blocks')}.")
        lines += [f"- {line}" for line in plan.get("auto") or []]
        if plan.get("auto_readings"):
            lines.append("- auto read: " + ", ".join(f"{k} {v}" for k, v in plan["auto_readings"].items()))
        lines.append("")
    lines += [
        "| # | shape | time | peak allocated / reserved | ≤ card? | OOM? | resident / streamed blocks | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for call in report["calls"]:
        shape = _shape_cell(call, smoke)
        if call["status"] == "skipped":
            lines.append(f"| {call['index'] + 1} | {shape} | skipped | | | | | {call['skip_reason']} |")
            continue
        stats = call.get("stats") or {}
        notes = list(call.get("events") or [])
        if call["status"] != "ok":
            err = call["error"]
            notes.insert(0, f"{err['type']} in {err['stage']}: {err['message']}".replace("|", "/"))
        notes += headroom_notes(call.get("replanning_delta") or {})
        peak = ("n/a (CPU)" if call.get("peak_reserved") is None else
                f"{_gib(call['peak_allocated'])} / {_gib(call['peak_reserved'])}")
        lines.append(f"| {call['index'] + 1} | {shape} | {_s(call.get('seconds'))} | {peak} | {_card_cell(call)} | "
                     f"{'**OOM**' if call['oom'] else 'no'} | {stats.get('resident_blocks')} / "
                     f"{stats.get('streamed_blocks')} | {'; '.join(notes)} |")
    s = report["summary"]
    line = f"**{s['oom']} of {s['ran']} calls ran out of memory**"
    if s["errors"]:
        line += f", {s['errors']} failed otherwise"
    if s["skipped"]:
        line += f", {s['skipped']} skipped (time budget)"
    if s["card_bytes"] is not None and s["largest_peak_reserved"] is not None:
        within = ("every call within the card" if s["all_within_card"] else
                  "over the card: " + ", ".join(s["over_card_shapes"]))
        line += (f"; largest peak {_gib(s['largest_peak_allocated'])} allocated / {_gib(s['largest_peak_reserved'])} "
                 f"reserved against the {_gib(s['card_bytes'])} card ({100 * s['largest_peak_share_of_card']:.0f} %)"
                 f"; {within}")
    else:
        line += "; no device peak to check against a card (CPU)"
    if s["target_met"] is not None:
        line += f". #40's target: {'met' if s['target_met'] else 'NOT met'}"
    lines += ["", line + ".", "",
              "Peak: `torch.cuda.max_memory_allocated` / `max_memory_reserved` over the call (reset before it); "
              "≤ card checks the larger of the two against the card. Notes: what the offload did during the call when "
              "memory ran out (the change in its counters), and its per-shape re-planning counters where it has them."]
    notes = [*report.get("notes", [])]
    if notes:
        lines += ["", "## Notes", "", *[f"- {n}" for n in dict.fromkeys(notes)]]
    return "\n".join(lines) + "\n"


# Main -----------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="flux", choices=MODELS_HERE)
    parser.add_argument("--card-gib", type=float, default=12.0, help="the emulated card's memory (GiB)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per call (memory, not speed)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated SIZExBATCH, run in this order (a square SIZE² image, BATCH images per "
                             f"prompt); default {DEFAULT_SHAPES}")
    parser.add_argument("--omni-attention", default="off",
                        help="attention omnify installs: off (Diffusers' processors), auto or a backend name")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: no call starts once they are spent, less --min-left (the rest: skipped)")
    parser.add_argument("--min-left", type=float, default=30.0, help="seconds of budget a call needs to start")
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny FLUX pipeline on the CPU, sizes ÷ {SMOKE_DIVISOR}, at most {SMOKE_STEPS} steps")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json and PREFIX.md (the runner, python "
                                                     "-m benchmarks run, chooses it)")
    args = parser.parse_args(argv)
    try:
        args.shape_list = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    if args.steps < 1:
        parser.error(f"--steps: {args.steps}; allowed: 1 or more")
    if args.card_gib <= 0:
        parser.error(f"--card-gib: {args.card_gib}; allowed: a size in GiB above 0")
    if args.smoke:
        args.steps = min(args.steps, SMOKE_STEPS)
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures the device's memory (--smoke runs it on the CPU)")
    # What pipeline_offload_bench's enable_strategy reads: the one omni run, max_device_memory="auto".
    args.omni_runs = omni_runs([AUTO], [])
    args.true_cfg = False
    args.expected_weight_bytes = 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = MODELS[args.model]
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    report: dict[str, Any] = {
        "environment": environment(device), "args": {k: v for k, v in vars(args).items() if k != "shape_list"},
        "model": args.model, "pipeline": spec.pipeline, "steps": args.steps,
        "shapes": [s.label for s in args.shape_list], "card_bytes": None if args.smoke else int(args.card_gib * GiB),
        "auto": None, "calls": [], "summary": None, "status": "running", "error": None,
        "notes": list(spec.notes) + ([f"CPU (smoke): the tiny FLUX pipeline, every size ÷ {SMOKE_DIVISOR}, "
                                      f"{args.steps} steps; no device peak, so no card check"] if args.smoke else [
            "The card is emulated by the per-process memory fraction, which caps what PyTorch's allocator reserves "
            "at the card: a call that needs more raises OutOfMemoryError rather than going over (the ≤ card column "
            "checks the cap held). The CUDA context (~0.5 GiB on a real card) is outside it."]),
    }

    def write() -> None:
        report["summary"] = summary(report["calls"], report["card_bytes"])
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
        out.with_suffix(".md").write_text(markdown(report))

    stage = "setup"
    reading = contextlib.ExitStack()  # the smoke's fake reading: kept for the calls (auto may read again per shape)
    try:
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            fraction = min(args.card_gib * GiB / total, 1.0)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            report.update(device_total_bytes=total, memory_fraction=fraction)
        report["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        stage = "build"
        pipe, build = build_pipeline(args.model, args.smoke)
        pipe.set_progress_bar_config(disable=True)
        report["build_s"] = build["build_s"]
        report["notes"] += build["notes"]
        report["weight_bytes"] = sum(e["param_bytes"] + e["buffer_bytes"] for e in build["components"].values())
        print(f"[{args.model}] built in {build['build_s']:.1f} s ({report['weight_bytes'] / 1e9:.2f} GB of weights)",
              flush=True)
        stage = "enable"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if args.smoke:
            from diffusers_omni import omnify

            # A refused enable changes nothing: the least budget the tiny pipeline allows, read from its error.
            least = least_device_budget(omnify(pipe, enable_attention=False), device, None)
            planned = least + max(report["weight_bytes"] - least, 0) // 2
            report["smoke_card_bytes"] = reading.enter_context(smoke_card(planned))
            report["notes"].append(
                f"CPU (smoke): auto read a fake MemAvailable of {_size(report['smoke_card_bytes'])} (its least "
                f"headroom, 1 GiB, plus {_size(planned)}: the least budget the tiny pipeline allows plus half the rest "
                "of its weight bytes), so that part of the tiny DiT stays resident and the rest streams, as on the "
                "card")
        start = time.perf_counter()
        target, backend = enable_strategy(STRATEGY, pipe, device, args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            report["enable_device_peak"] = torch.cuda.max_memory_allocated(device)
        report["enable_s"] = time.perf_counter() - start
        target.set_progress_bar_config(disable=True)
        report["auto"] = omni_plan(target, backend, args.omni_runs[STRATEGY], getattr(args, "omni_passed_budget", AUTO))
        report["auto"]["stats_after_enable"] = call_stats(stats_dict(backend))
        print(f"[{args.model}] enabled in {report['enable_s']:.1f} s; " + "; ".join(report["auto"]["auto"]), flush=True)
        write()

        stage = "calls"
        modules = {t: getattr(pipe, t) for t in spec.transformers if getattr(pipe, t, None) is not None}
        clock = PhaseClock(device)
        clock.attach(modules)

        def make_kwargs(shape: Shape) -> dict[str, Any]:
            side = run_size(shape, args.smoke)
            return {**call_kwargs(args.model, args, args.steps), "height": side, "width": side,
                    "num_images_per_prompt": shape.batch}

        def left() -> float | None:
            return None if args.time_budget is None else args.time_budget - (time.perf_counter() - started)

        def record(row: dict[str, Any]) -> None:
            report["calls"].append(row)
            write()

        run_calls(args.shape_list, target, backend, make_kwargs, clock, device, report["card_bytes"], args.steps,
                  left, args.min_left, record)
        clock.detach()
        report["status"] = "ok"
    except Exception as error:  # noqa: BLE001 - setup failed (build / enable): recorded, the report still written
        traceback.print_exc()
        report.update(status="error", error=_error(stage, error))
    finally:
        reading.close()
    report["wall_s"] = time.perf_counter() - started
    write()
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out.with_suffix('.json')} and .md")
    return 0 if report["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
