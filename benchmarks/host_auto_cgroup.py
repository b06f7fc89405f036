"""``max_host_memory="auto"`` under a real RAM cap (#40): a memory cgroup the kernel enforces, not an injected
reading.

A FLUX.1-shaped pipeline whose transformer is larger than the room the cap leaves is saved to a checkpoint folder;
each run is a child process placed in a fresh memory cgroup (v2, else v1's memory controller) before it starts,
which loads the pipeline as a user would (``from_pretrained``, the transformer as views of its files:
``load_transformer_mmap``) and generates twice:

Before each run the checkpoint's pages are dropped from the page cache, so what a run reads is charged to its own
cgroup.

- ``resident``: no offload, in a cgroup without a limit (the reference image; its RSS after loading is the
  baseline the cap is set from);
- ``auto``: ``enable_layerwise_offload(max_host_memory="auto")`` under the cap: auto reads the cgroup, keeps what it
  allows as host copies and reads the other blocks from the checkpoint at each use;
- ``no-budget``: the same offload without a host budget under the same cap (every block copied into RAM): what
  the cap does to an offload that does not read it.

The cap is the resident run's RSS after loading (the process and its small components) + ``--cap-extra-gib``
(auto's margin is at least 1 GiB of what it reads, and the room left is where host copies go). Per run: the exit
status (a kill by the cap is a signal), the cgroup's peak usage and its OOM kills, what auto read and chose, the
blocks read from disk, and whether each image is bitwise the resident one.

Needs permission to create cgroups (root in most containers); without it the report says so. ``--smoke``: tiny
sizes, children without a cgroup (the script's path, not the cap).

    python -m benchmarks run host-auto-cgroup
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import random_parameters_on
from diffusers_omni.offload.budget import own_cgroups

GiB = 1 << 30
RUNS = ("resident", "auto", "no-budget")


# Cgroups -------------------------------------------------------------------------------------------------------


class Cgroup:
    """A fresh memory cgroup: v2 under the unified mount's root, else v1's memory controller beside this process's
    own cgroup. ``limit`` None: no limit (a run measured, not capped)."""

    def __init__(self, name: str, limit: int | None, root: Path = Path("/sys/fs/cgroup")) -> None:
        self.version, self.path = self._create(name, root)
        self.limit = limit
        if limit is not None:
            self._write("memory.max" if self.version == 2 else "memory.limit_in_bytes", str(limit))
            if self.version == 1 and (self.path / "memory.memsw.limit_in_bytes").exists():
                self._write("memory.memsw.limit_in_bytes", str(limit))  # no escape into swap

    @staticmethod
    def _create(name: str, root: Path) -> tuple[int, Path]:
        candidates = []  # (version, the folder the new cgroup goes in)
        if (root / "cgroup.controllers").exists() and "memory" in (root / "cgroup.subtree_control").read_text():
            candidates.append((2, root))
        v1 = root / "memory"
        if (v1 / "memory.limit_in_bytes").exists():
            own = v1 / own_cgroups().get(1, "/").lstrip("/")
            candidates.append((1, own if own.is_dir() else v1))
        errors = []
        for version, parent in candidates:
            path = parent / name
            try:
                path.mkdir()
                return version, path
            except OSError as error:
                errors.append(f"v{version} {path}: {error}")
        raise PermissionError("could not create a memory cgroup: " + ("; ".join(errors) or
                                                                      f"no memory controller under {root}"))

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def _read(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except OSError:
            return None

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run by a shell that first moves itself into this cgroup, then execs it (the command starts
        inside; no ``preexec_fn`` in a process that already runs threads)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def readings(self) -> dict[str, Any]:
        """The cgroup's peak usage (``None`` where the kernel does not keep it) and its OOM kills."""
        peak = self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        events = self._read("memory.events" if self.version == 2 else "memory.oom_control") or ""
        kills = next((int(line.split()[1]) for line in events.splitlines() if line.startswith("oom_kill ")), None)
        failcnt = self._read("memory.failcnt") if self.version == 1 else None
        return {"version": self.version, "path": str(self.path), "limit": self.limit,
                "peak": int(peak) if peak and peak.strip().isdigit() else None, "oom_kills": kills,
                "limit_hits": int(failcnt) if failcnt and failcnt.strip().isdigit() else None}

    def remove(self) -> None:
        for _ in range(50):  # the child has exited; the kernel frees the cgroup's charge shortly after
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


# The pipeline --------------------------------------------------------------------------------------------------


def transformer_config(args: argparse.Namespace) -> dict[str, Any]:
    from diffusers_omni.testing.tiny import tiny_flux_components

    tiny = dict(tiny_flux_components(0)["transformer"].config)
    if args.smoke:
        return {**tiny, "num_layers": 2, "num_single_layers": 4}
    return {**tiny, "num_layers": args.double_blocks, "num_single_layers": args.single_blocks,
            "attention_head_dim": 128, "num_attention_heads": args.heads, "axes_dims_rope": [16, 56, 56]}


def save_pipeline(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The tiny FLUX.1 pipeline with a transformer of ``transformer_config``, bf16, random weights, saved."""
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from diffusers_omni.testing.tiny import tiny_flux_components

    start = time.perf_counter()
    components = tiny_flux_components(0)
    with torch.device("meta"):
        transformer = FluxTransformer2DModel.from_config(transformer_config(args))
    transformer = random_parameters_on(transformer, "cpu", torch.bfloat16)
    components["transformer"] = transformer
    pipe = FluxPipeline(**components)
    pipe.to(torch.bfloat16)
    pipe.save_pretrained(folder)
    nbytes = sum(p.numel() * p.element_size() for p in transformer.parameters())
    return {"transformer_bytes": nbytes, "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
            "save_s": time.perf_counter() - start}


def rss() -> dict[str, int]:
    """This process's RSS now and at its peak, and its anonymous part now (``/proc/self/status``)."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) * 1024
    return found


def child(args: argparse.Namespace) -> int:
    """One run (``--child``): load, maybe enable, generate twice; writes its JSON to ``--child-out``."""
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from diffusers_omni import omnify
    from diffusers_omni.offload.loading import load_transformer_mmap

    folder = Path(args.folder)
    result: dict[str, Any] = {"run": args.child, "stage": "load"}
    out = Path(args.child_out)

    lock = threading.Lock()

    def save() -> None:  # whole files only (a kill may come at any time), one writer at a time
        with lock:
            text = json.dumps(dict(result), indent=1)
            Path(f"{out}.tmp").write_text(text)
            os.replace(f"{out}.tmp", out)

    save()
    transformer = load_transformer_mmap(FluxTransformer2DModel, folder, "transformer", torch_dtype=torch.bfloat16)
    pipe = FluxPipeline.from_pretrained(folder, transformer=transformer, torch_dtype=torch.bfloat16)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            component.eval()
    result["rss_loaded"] = rss()
    result["stage"] = "enable"
    save()
    target = pipe
    if args.child == "resident" and args.device != "cpu":
        pipe.to(args.device)  # the reference on the device the offloaded runs compute on
    if args.child != "resident":
        omni = omnify(pipe, enable_attention=False)
        start = time.perf_counter()
        backend = omni.enable_layerwise_offload(device=args.device,
                                                max_host_memory="auto" if args.child == "auto" else None)
        result["enable_s"] = time.perf_counter() - start
        target = omni
    result["rss_enabled"] = rss()
    if args.child != "resident":
        result["offload"] = offload_record(backend)
    save()
    stop = threading.Event()

    def sample() -> None:  # the peaks of the anonymous and file-backed RSS, saved as they grow (a kill loses none)
        while True:
            now = rss()
            peaks = result.setdefault("rss_peaks", {"RssAnon": 0, "RssFile": 0})
            if any(now[k] > peaks[k] for k in peaks):
                result["rss_peaks"] = {k: max(now[k], peaks[k]) for k in peaks}
                try:
                    save()
                except RuntimeError:  # the main thread changed the result meanwhile: saved at the next sample
                    pass
            if stop.wait(0.02):
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    digests, seconds = [], []
    for call in range(2):
        result["stage"] = f"generate (call {call + 1})"
        save()
        start = time.perf_counter()
        image = target("a photo of a cat", num_inference_steps=args.steps, height=args.size, width=args.size,
                       guidance_scale=3.5, max_sequence_length=16, output_type="pt",
                       generator=torch.Generator().manual_seed(0)).images
        seconds.append(time.perf_counter() - start)
        digests.append(hashlib.sha256(image.float().cpu().numpy().tobytes()).hexdigest())
    stop.set()
    sampler.join()
    result.update({"digests": digests, "call_s": seconds, "rss_end": rss()})
    if args.child != "resident":
        result["offload"] = offload_record(backend)
        result["stage"] = "disable"
        save()
        omni.disable_omni_offload()
        result["rss_disabled"] = rss()
    result["stage"] = "done"
    save()
    return 0


def offload_record(backend: Any) -> dict[str, Any]:
    """What the offload read, chose and holds (recorded right after enabling, and again at the end)."""
    stats = backend.stats
    return {"auto": list(stats.auto), "auto_readings": dict(stats.auto_readings or {}),
            "disk_blocks": stats.disk_blocks, "streamed_blocks": stats.streamed_blocks,
            "host_bytes": stats.host_bytes, "staging_bytes": stats.staging_bytes,
            "in_flight_capacity": stats.in_flight_capacity,
            "host_budget": getattr(backend.config, "max_host_memory", None)}


def drop_page_cache(folder: Path) -> None:
    """Write the checkpoint's files out and drop their pages (``POSIX_FADV_DONTNEED``): the pages a run reads are
    then charged to its own cgroup, not left charged to the process that wrote them."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def spawn(run: str, args: argparse.Namespace, folder: Path, work: Path, group: Cgroup | None) -> dict[str, Any]:
    drop_page_cache(folder)
    out = work / f"{run}.json"
    argv = [sys.executable, "-m", "benchmarks.host_auto_cgroup", "--child", run, "--folder", str(folder),
            "--child-out", str(out), "--device", args.device, "--steps", str(args.steps), "--size", str(args.size),
            "--out", str(work / "unused")]
    start = time.perf_counter()
    process = subprocess.run(group.wrap(argv) if group is not None else argv, capture_output=True,
                             text=True, timeout=args.timeout)
    result = json.loads(out.read_text()) if out.exists() else {"run": run, "stage": "start"}
    result["seconds"] = time.perf_counter() - start
    result["exit"] = process.returncode
    if process.returncode < 0:
        result["signal"] = signal.Signals(-process.returncode).name
    if process.returncode != 0:
        result["stderr_tail"] = process.stderr[-3000:]
    if group is not None:
        result["cgroup"] = group.readings()
    return result


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / GiB:.2f} GiB"


def describe(report: dict[str, Any]) -> str:
    """One paragraph: the machine, the pipeline, the cap (the report's and the docs' table say it first)."""
    pipeline = report["pipeline"]
    text = (f"{report['machine']}; torch {report['torch']}; device {report['device']}. A FLUX.1-shaped pipeline, "
            f"transformer {pipeline['transformer_parameters']:,} parameters ({_gib(pipeline['transformer_bytes'])} "
            f"bf16, random weights) loaded as views of its checkpoint; {report['steps']} steps at "
            f"{report['size']}², two calls per run.")
    if report.get("cgroup_error"):
        text += f" **No cgroup**: {report['cgroup_error']}."
    if report.get("cap") is not None:
        text += (f" Cap: {_gib(report['cap'])} (the resident run's RSS after loading, {_gib(report['baseline'])}, + "
                 f"{report['cap_extra_gib']:g} GiB).")
    return text


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The runs' table (header, rows): what the cgroup saw, what auto chose, whether the image held."""
    header = ["run", "cgroup limit", "exit", "cgroup peak", "OOM kills", "anonymous RSS peak", "auto chose",
              "blocks from disk", "host copies", "same image as resident"]
    reference = report["runs"][0].get("digests")
    rows = []
    for r in report["runs"]:
        group = r.get("cgroup") or {}
        offload = r.get("offload") or {}
        chose = next((a.split(":", 1)[1].split("(")[0].strip() for a in offload.get("auto", [])
                      if a.startswith("max_host_memory=auto")), "")
        exit_text = "0" if r["exit"] == 0 else f"{r.get('signal') or r['exit']} (at {r.get('stage')})"
        same = ("reference" if r is report["runs"][0] else
                "" if not r.get("digests") or not reference else
                "yes" if r["digests"] == reference else "**NO**")
        rows.append([r["run"], _gib(group.get("limit")) or "none", exit_text, _gib(group.get("peak")),
                     "" if group.get("oom_kills") is None else str(group["oom_kills"]),
                     _gib((r.get("rss_peaks") or {}).get("RssAnon")), chose,
                     str(offload.get("disk_blocks", "")), _gib(offload.get("host_bytes")), same])
    return header, rows


NOTE = ("cgroup peak: `memory.peak` (v2) / `memory.max_usage_in_bytes` (v1), page cache included (the kernel "
        "reclaims it under the cap, so a run that reads its checkpoint reaches the limit). Anonymous RSS peak: the "
        "child's `RssAnon`, sampled every 20 ms while it generates.")


def markdown(report: dict[str, Any]) -> str:
    header, rows = table_rows(report)
    lines = ["# max_host_memory=auto under a memory cgroup", "", describe(report), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", NOTE, ""]
    for r in report["runs"]:
        for line in (r.get("offload") or {}).get("auto", []):
            lines.append(f"- {r['run']}: {line}")
        if r.get("exit") not in (0, None) and r.get("stderr_tail") and not r.get("signal"):
            lines.append(f"- {r['run']} failed: {r['stderr_tail'].strip().splitlines()[-1]}")
    lines.append("")
    lines.append(f"**{report['verdict']}**")
    return "\n".join(lines) + "\n"


def verdict(report: dict[str, Any]) -> str:
    runs = {r["run"]: r for r in report["runs"]}
    auto, resident = runs.get("auto", {}), runs.get("resident", {})
    if report.get("cap") is None:
        return "not capped: " + (report.get("cgroup_error") or "smoke run (no cgroup)")
    ok = (auto.get("exit") == 0 and (auto.get("cgroup") or {}).get("oom_kills") in (0, None)
          and auto.get("digests") == resident.get("digests") and bool(resident.get("digests")))
    parts = [f"auto under the cap: {'held, same image' if ok else 'FAILED'}"]
    other = runs.get("no-budget")
    if other is not None:
        parts.append("no host budget under the same cap: " + (
            f"killed ({other.get('signal') or other['exit']}, at {other.get('stage')})" if other["exit"] != 0
            else "ran (the cap left room for every host copy)"))
    return "; ".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--double-blocks", type=int, default=6)
    parser.add_argument("--single-blocks", type=int, default=16)
    parser.add_argument("--heads", type=int, default=12, help="attention heads of 128 (width = 128 × heads)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (the tiny VAE: 2× downsampling)")
    parser.add_argument("--cap-extra-gib", type=float, default=2.0,
                        help="the cap is the resident run's RSS after loading plus this")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no cgroup")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json and PREFIX.md")
    parser.add_argument("--child", default=None, choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke and args.child is None:  # the script's path on the CPU, whatever device and sizes the scenario names
        args.device, args.size, args.steps = "cpu", 32, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return child(args)

    import platform

    import torch

    work = Path(tempfile.mkdtemp(prefix="omni-host-auto-"))
    report: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "steps": args.steps,
                              "size": args.size, "cap_extra_gib": args.cap_extra_gib, "argv": sys.argv[1:],
                              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "runs": []}
    groups: list[Cgroup] = []
    try:
        folder = work / "pipeline"
        report["pipeline"] = save_pipeline(args, folder)
        tag = f"omni-host-auto-{os.getpid()}"

        def group(run: str, limit: int | None) -> Cgroup | None:
            if args.smoke or report.get("cgroup_error"):
                return None
            try:
                made = Cgroup(f"{tag}-{run}", limit)
            except (PermissionError, OSError) as error:
                report["cgroup_error"] = str(error)
                return None
            groups.append(made)
            return made

        resident = spawn("resident", args, folder, work, group("resident", None))
        report["runs"].append(resident)
        print(json.dumps({k: v for k, v in resident.items() if k != "stderr_tail"}), flush=True)
        if resident["exit"] != 0:
            raise RuntimeError(f"the resident run failed: {resident.get('stderr_tail')}")
        report["baseline"] = resident["rss_loaded"]["VmRSS"]
        cap = report["baseline"] + int(args.cap_extra_gib * GiB)
        for run in ("auto", "no-budget"):
            made = group(run, cap)
            report["cap"] = cap if made is not None else None
            result = spawn(run, args, folder, work, made)
            report["runs"].append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "stderr_tail"}), flush=True)
    finally:
        for made in groups:
            made.remove()
        shutil.rmtree(work, ignore_errors=True)
    report["verdict"] = verdict(report)
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(report, indent=1))
    Path(f"{prefix}.md").write_text(markdown(report))
    print(report["verdict"])
    auto = next(r for r in report["runs"] if r["run"] == "auto")
    return 0 if auto["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
