"""Every benchmark scenario, in one table: what it runs, what it measures, where it runs and which docs it feeds.

A scenario is one script run with fixed arguments; its results live in ``benchmarks/results/<suite>/`` where the
suite is the scenario's name (a scenario that writes a second report, ``hopper``'s end-to-end steps, names it in
``extra_outputs``). ``python -m benchmarks --list`` prints this table; ``python -m benchmarks run NAME`` runs one row
of it and files the result through ``benchmarks.results_io`` (the one writer). Adding a scenario is adding a row here
and, where the measurement is new, a script under ``benchmarks/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# How a script takes its output location (the runner always chooses it):
#   prefix: ``--out PREFIX`` writes PREFIX.json (the payload) and, where it makes them, PREFIX.md / .png / .txt
#   file:   ``--out FILE.json`` writes only that file
#   folder: ``--out DIR`` writes DIR/<payload> and other files (images) beside it
OutputKind = Literal["prefix", "file", "folder"]
Device = Literal["gpu", "cpu"]

README = "README.md"
DENSE = "docs/user_guide/backends/dense.md"
SAGE = "docs/user_guide/backends/sage.md"
FP8 = "docs/user_guide/backends/fp8.md"
RAINFUSION = "docs/user_guide/backends/rainfusion.md"
OFFLOAD = "docs/user_guide/offload.md"
DISTRIBUTED = "docs/user_guide/distributed_offload.md"
QUALITY = "docs/user_guide/quality.md"
TUNING = "docs/user_guide/tuning.md"
INTEROP = "docs/user_guide/interop.md"
DESIGN_OFFLOAD = "docs/design/offload.md"

NO_FA3 = "FA3 hidden (fa3-fwd not installed): stands in for an Ampere/Ada user"


@dataclass(frozen=True)
class Scenario:
    """One benchmark run: ``python -m benchmarks.<script> <args> --out <chosen by the runner>``.

    Args:
        name: the scenario's name, also its results folder ``benchmarks/results/<name>/``.
        script: the module under ``benchmarks/`` that measures.
        measures: one line: what the result holds.
        device: ``"gpu"`` (its numbers come from an H200, through ``benchmarks/h200/run_all.sh``) or ``"cpu"``.
        docs: the pages whose rendered tables read this scenario's results (``benchmarks/docs_tables.py``).
        args: the script's own options for this scenario (its argparse keeps them).
        smoke: the options that make the script a quick check of itself (tiny sizes, CPU); ``None``: it has none.
        label: a sentence saying what is special about this run's environment (recorded in ``meta.label``).
        label_arg: the script's option that also records the label in its payload (``--label``), if it has one.
        out: how the script takes its output location (see ``OutputKind``).
        payload: for ``out="folder"``: the payload's file name inside the folder.
        extra_outputs: further reports of the same run: suite name → the script's option taking a JSON path.
        merges_previous: the script merges its new runs into the file at ``--out`` (the runner seeds it with the
            suite's latest payload).
        launcher: ``"torchrun"``: one process per GPU (two CPU processes with ``--smoke``).
    """

    name: str
    script: str
    measures: str
    device: Device
    docs: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    smoke: tuple[str, ...] | None = ("--smoke",)
    label: str | None = None
    label_arg: str | None = None
    out: OutputKind = "prefix"
    payload: str = "result.json"
    extra_outputs: tuple[tuple[str, str], ...] = field(default=())
    merges_previous: bool = False
    launcher: Literal["python", "torchrun"] = "python"

    @property
    def suites(self) -> tuple[str, ...]:
        """The results folders this scenario writes: its own, then its extra reports'."""
        return (self.name, *(suite for suite, _ in self.extra_outputs))


_QUANT_FLUX = ("--models", "flux")
_FIVE_FORMATS = ("--formats", "torchao-float8,bnb-nf4,torchao-int8,gguf-q8_0,gguf-q4_k")
_QUANT_SMOKE = ("--smoke", "--device", "cpu")
# Whole-pipeline offload: strategies in the order they run (the time budget skips the last ones first); one device
# call is 10 minutes, the wheels' install included, so no strategy starts after 450 s and a running one stops at 480 s.
_PIPELINE_FLUX = "resident,omni,diffusers-group,mmgp2,mmgp4,diffusers-sequential,diffusers-model"
_PIPELINE_QWEN = "resident,omni,diffusers-group,mmgp2,mmgp4,diffusers-model"
_PIPELINE_WAN = "resident,omni,diffusers-group,omni-budget"
_PIPELINE_TIME = "450"
# The device-budget sweep (#40): one child per budget, auto (read from the emulated card) last, then auto again with
# compression="lossless". At the committed pipeline-offload-flux timings a child takes ~50-70 s on the H200 (start-up
# and CUDA init ~20 s, build ~13 s, enable 12-18 s, warm-up ~2 s, the timed call 9-13 s), so the ten runs want ~600
# s: the time budget skips the last ones first (resident's 48 s and omni's 70 s come first).
_FLUX_SWEEP = "9GiB,10GiB,11GiB,6GiB,4GiB"
# auto first, then the sweep's budgets, every one against the same card in one run (the last ones are the ones a
# time budget skips: 6 and 4 GiB keep fewer blocks than 8 and are not the fastest); resident and seven budgets at
# ~55-65 s a child want ~500 s of the call's 600.
_FLUX_AUTO_SWEEP = "auto,8GiB,9GiB,10GiB,11GiB,6GiB,4GiB"
_PIPELINE_SWEEP_TIME = "520"

# offload_bench beside a baseline commit's tree (benchmarks/h200/side_by_side.sh, .baseline/ and .whl/ carried; set
# BASELINE_COMMIT and OMNI_COMMIT): MODEL:BASELINE_VARIANTS:CURRENT_VARIANTS[:BUDGET], an empty BASELINE_VARIANTS runs
# only this tree (FLUX's lossless is new, the baseline has none).
_SIDE_BY_SIDE = ("wan:layerwise:layerwise:12GiB", "flux::layerwise,lossless:12GiB")

SCENARIOS: tuple[Scenario, ...] = (
    # Attention ---------------------------------------------------------------------------------------------------
    Scenario("attention", "attention_bench", "TFLOP/s and error of every attention backend at the models' shapes",
             "gpu", (DENSE, SAGE), smoke=None),
    Scenario("sage", "sage_bench", "sageattn called directly: kernels, KV-length error sweep, pipelines", "gpu",
             (SAGE,), smoke=None),
    Scenario("hopper", "hopper_bench", "Hopper lossy paths: FP8 and block-sparse kernels, targets", "gpu",
             (README, FP8, RAINFUSION), extra_outputs=(("hopper-e2e", "--e2e"),)),
    Scenario("fp8-numerics", "fp8_numerics", "FP8 error budget and quantisation variants (FA3 emulated)", "cpu",
             (FP8,)),
    Scenario("tiny-latents", "tiny_latents", "latent error of the lossy Hopper modes on the tiny pipelines", "cpu",
             (FP8,), out="file", smoke=None),
    Scenario("sparse-probe", "sparse_schedule_probe", "block-sparse kernel: work order and L2 reuse (probe)", "gpu",
             (), smoke=None),
    Scenario("tune", "tune_bench", "tune's time and picks, whole step of every candidate configuration", "gpu",
             (TUNING,), args=("--models", "flux,wan,qwen"), label="all kernels installed", label_arg="--label"),
    Scenario("tune-no-fa3", "tune_bench", "tune with FA3 hidden (run_all.sh installs the wheels without fa3-fwd)",
             "gpu", (TUNING,), args=("--models", "flux,wan,qwen"), label=NO_FA3, label_arg="--label"),
    Scenario("tune-no-fa3-flux", "tune_bench", "tune with FA3 hidden, FLUX size again with 15 rounds", "gpu",
             (TUNING,), args=("--models", "flux", "--rounds", "15"),
             label="FA3 hidden (fa3-fwd not installed), FLUX again with 15 rounds", label_arg="--label"),
    Scenario("tune-lossy", "tune_bench", "tune with the lossy modes measured beside the exact ones (their errors)",
             "gpu", (TUNING,), args=("--models", "flux,wan,qwen", "--lossy"), label="all kernels installed",
             label_arg="--label"),
    Scenario("quality", "quality_bench", "lossy modes: output error, PSNR/SSIM and side-by-side images", "gpu",
             (README, QUALITY), out="folder", payload="quality.json"),
    Scenario("headroom-check", "headroom_check", "auto's per-shape headroom on the device, bit for bit: blocks "
             "kept through their store (pinned, lossless) and streamed first for a larger shape, tiny FLUX.1 bf16",
             "gpu", ()),
    Scenario("lossless-pool-probe", "lossless_pool_probe", "FLUX.1-dev-width slice streamed plain and lossless: the "
             "code's device buffers as a ring made once (now) against a fresh buffer per load (before), and lossless "
             "with every block resident: step, max allocated / reserved, bitwise", "gpu", (OFFLOAD,)),
    Scenario("dfloat11-decode-probe", "dfloat11_probe", "a FLUX.1-dev-double-block-sized unit (340 M bf16 weights, "
             "random) in DFloat11's format: decoded by our Triton kernel and by tensor operations, our lossless "
             "code's kernel on the same weights, and the pinned copies of each code: whether streaming DFloat11's "
             "own code could keep up with the link", "gpu", (OFFLOAD,)),
    Scenario("dfloat11-host", "dfloat11_host_bench", "a FLUX.1-dev-size transformer under max_host_memory=8GiB, "
             "page cache dropped before each forward: blocks read from its bf16 checkpoint against blocks read coded "
             "from its DFloat11 checkpoint (load_dfloat11, the disk (DFloat11) store): load, enable, first and median "
             "forward, bytes read, bitwise", "gpu", ()),
    Scenario("vae-workspace-probe", "vae_workspace_probe", "the FLUX.1 VAE decoding the same latents with less and "
             "less device memory free under a 12 GiB cap: whether cuDNN's choice, so the bits, follow free memory",
             "gpu", (OFFLOAD,)),
    Scenario("gpu-pipeline-check", "gpu_pipeline_check", "tiny FLUX.1 pipeline through omni attention vs stock",
             "gpu", (README,), out="file", smoke=None),
    Scenario("alignment", "alignment_gpu", "deterministic mode: bitwise repeatability per backend", "gpu",
             (), smoke=None),
    Scenario("info", "platform_info", "`diffusers-omni info` on the machine (JSON and text)", "gpu", (),
             smoke=None),
    # Offload -----------------------------------------------------------------------------------------------------
    Scenario("offload-flux", "offload_bench", "FLUX.1-dev size: layerwise vs Diffusers' group offload vs resident",
             "gpu", (README, OFFLOAD, DESIGN_OFFLOAD), args=("--models", "flux", "--variants", "layerwise,diffusers")),
    Scenario("offload-wan", "offload_bench", "Wan2.2-14B size: layerwise vs Diffusers' group offload vs resident",
             "gpu", (README, OFFLOAD), args=("--models", "wan", "--skip-model-level")),
    Scenario("offload-flux-budget", "offload_bench", "FLUX.1-dev size with max_device_memory=12GiB", "gpu",
             (README, OFFLOAD, DESIGN_OFFLOAD), args=("--models", "flux", "--variants", "layerwise,budget")),
    Scenario("offload-flux-lossless", "offload_bench", "FLUX.1-dev size: layerwise with compression=lossless vs plain, "
             "and with compression_cache_dir (the enable that writes it, then one that reads it)",
             "gpu", (), args=("--models", "flux", "--variants", "layerwise,lossless,lossless-cache")),
    Scenario("offload-side-by-side", "side_by_side",
             "offload_bench of this tree beside a baseline commit's (benchmarks/h200/side_by_side.sh), step times "
             "compared", "gpu", (OFFLOAD,), args=_SIDE_BY_SIDE, smoke=None),
    Scenario("host-auto-cgroup", "host_auto_cgroup",
             "max_host_memory=auto under a memory cgroup the kernel enforces (this machine, root): a FLUX.1-shaped "
             "pipeline whose transformer exceeds the cap's room, loaded as views of its checkpoint; resident, auto "
             "under the cap, no host budget under the same cap", "cpu", (OFFLOAD,)),
    Scenario("host-auto-cgroup-gpu", "host_auto_cgroup",
             "max_host_memory=auto under a memory cgroup on the GPU machine: a FLUX.1-dev-size transformer (19 + 38 "
             "blocks, 23.8 GB bf16) behind the tiny encoders, loaded as views of its checkpoint, computing on the GPU; "
             "resident, auto under a cap of the resident RSS + 12 GiB, no host budget under the same cap", "gpu", (),
             args=("--device", "cuda", "--double-blocks", "19", "--single-blocks", "38", "--heads", "24",
                   "--size", "256", "--steps", "4", "--cap-extra-gib", "12")),
    Scenario("codec-ratio", "codec_ratio", "lossless code's ratio on trained weights (PyPI wheels) and random ones",
             "cpu", (OFFLOAD,), smoke=("--random-weights", "4096")),
    Scenario("offload-distributed-flux", "offload_bench", "FLUX.1-dev size: distributed layerwise (N = 1), mmap",
             "gpu", (DISTRIBUTED, DESIGN_OFFLOAD),
             args=("--models", "flux", "--variants", "layerwise,budget,distributed,mmap", "--skip-model-level")),
    Scenario("offload-distributed-wan", "offload_bench", "Wan2.2-14B size: distributed layerwise (N = 1), mmap",
             "gpu", (DISTRIBUTED,),
             args=("--models", "wan", "--variants", "layerwise,distributed,mmap", "--skip-model-level")),
    Scenario("offload-multigpu", "distributed_offload_bench", "distributed layerwise on every GPU of the host", "gpu",
             (), args=("--models", "flux,wan"), launcher="torchrun"),
    Scenario("offload-lifecycle", "offload_lifecycle_bench", "enable/drop cycles and 100 steps: nothing leaks", "gpu",
             (OFFLOAD,)),
    Scenario("offload-concurrency", "offload_concurrency_check", "offloaded forwards from several threads", "gpu",
             (OFFLOAD,)),
    Scenario("offload-timeline", "offload_timeline", "where an offloaded quantized step loses time (GPU timeline)",
             "gpu", (), args=("--time-budget", "300"), smoke=None),
    Scenario("quant-offload-flux", "quant_offload_bench", "FLUX.1-dev size, five quantized formats, per-block times",
             "gpu", (OFFLOAD,), args=(*_QUANT_FLUX, *_FIVE_FORMATS, "--warmup", "1", "--repeats", "5",
                                      "--per-block", "--time-budget", "260"), smoke=_QUANT_SMOKE),
    Scenario("quant-offload-wan", "quant_offload_bench", "Wan2.2-14B size, 8-bit formats", "gpu", (OFFLOAD,),
             args=("--models", "wan", "--formats", "torchao-float8,torchao-int8,gguf-q8_0", "--warmup", "1",
                   "--repeats", "2", "--time-budget", "230"), smoke=_QUANT_SMOKE),
    Scenario("quant-offload-wan-4bit", "quant_offload_bench", "Wan2.2-14B size, 4-bit formats", "gpu", (OFFLOAD,),
             args=("--models", "wan", "--formats", "gguf-q4_k,bnb-nf4", "--warmup", "1", "--repeats", "2",
                   "--time-budget", "200"), smoke=_QUANT_SMOKE),
    Scenario("quant-offload-traffic", "quant_offload_bench", "what the copies alone cost the resident compute", "gpu",
             (OFFLOAD,), args=(*_QUANT_FLUX, *_FIVE_FORMATS, "--warmup", "1", "--repeats", "5", "--copy-traffic",
                               "--no-peak-trace", "--time-budget", "330"), smoke=_QUANT_SMOKE),
    Scenario("quant-offload-deeper", "quant_offload_bench", "a deeper prefetch window against the default one", "gpu",
             (OFFLOAD,), args=(*_QUANT_FLUX, "--formats", "torchao-int8,gguf-q8_0", "--warmup", "1", "--repeats",
                               "3", "--deeper", "3", "--no-peak-trace", "--time-budget", "150"), smoke=_QUANT_SMOKE),
    Scenario("quant-offload-budget", "quant_offload_bench", "max_device_memory 2.5 and 3 GiB, copy-bound formats",
             "gpu", (OFFLOAD,), args=(*_QUANT_FLUX, "--formats", "torchao-int8,gguf-q8_0", "--warmup", "1",
                                      "--repeats", "3", "--budget", "2.5,3", "--per-block", "--no-peak-trace"),
             smoke=_QUANT_SMOKE),
    Scenario("quant-offload-budget-more", "quant_offload_bench", "max_device_memory 3.5, 4 and 5 GiB", "gpu",
             (OFFLOAD,), args=(*_QUANT_FLUX, "--formats", "gguf-q8_0,torchao-int8", "--warmup", "1", "--repeats",
                               "5", "--budget", "3.5,4,5", "--no-peak-trace"), smoke=_QUANT_SMOKE),
    Scenario("quant-offload-budget-float8", "quant_offload_bench",
             "a budget never slower than none: torchao float8 and int8, no budget vs max_device_memory 2.5 and 3 GiB",
             "gpu", (OFFLOAD,), args=(*_QUANT_FLUX, "--formats", "torchao-float8,torchao-int8", "--warmup", "1",
                                      "--repeats", "5", "--budget", "2.5,3", "--no-peak-trace", "--time-budget",
                                      "200"), smoke=_QUANT_SMOKE),
    Scenario("quant-offload-check", "quant_offload_check", "every format × strategy bitwise on tiny models, LoRA",
             "gpu", (OFFLOAD,), smoke=("--device", "cpu")),
    Scenario("peak-probe", "peak_probe", "what is alive at the offloaded peak (GGUF Q4_K)", "gpu", (),
             args=("--format", "gguf-q4_k"), smoke=None),
    Scenario("peak-diff", "peak_probe", "omni's and Diffusers' peaks, live bytes replayed", "gpu", (OFFLOAD,),
             args=("--diff", "--format", "gguf-q4_k"), smoke=None),
    # Whole pipelines (prompt → image/video) under offload on an emulated card, every strategy in its own process ----
    Scenario("pipeline-offload-flux", "pipeline_offload_bench",
             "FLUX.1-dev pipeline end to end (28 steps) on an emulated 12 GiB card: omni (and with an 8 GiB budget) "
             "vs Diffusers' offloads vs mmgp", "gpu", (README, OFFLOAD),
             args=("--model", "flux", "--card-gib", "12", "--steps", "28", "--strategies", _PIPELINE_FLUX,
                   "--omni-budget", "8GiB", "--sequential-steps", "4", "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-flux-auto", "pipeline_offload_bench",
             "FLUX.1-dev pipeline end to end (28 steps) on an emulated 12 GiB card: resident, then "
             "max_device_memory=auto (its reading, choice and per-shape headroom recorded) and the budget sweep "
             "8, 9, 10, 11, 6 and 4 GiB in the same run, a plot of end to end against the budget with auto's choice "
             "marked (#40: auto within 1.05 of the sweep's fastest)", "gpu", (OFFLOAD,),
             args=("--model", "flux", "--card-gib", "12", "--steps", "28", "--strategies", "resident",
                   "--omni-budget", _FLUX_AUTO_SWEEP, "--time-budget", _PIPELINE_SWEEP_TIME)),
    Scenario("pipeline-offload-flux-auto-peers", "pipeline_offload_bench",
             "FLUX.1-dev pipeline end to end (28 steps) on an emulated 12 GiB card: resident, max_device_memory=auto, "
             "the sweep's fastest budget (11 GiB), Diffusers' pipeline-level group offload and mmgp profile 2 in one "
             "run (#40: the peers beside auto; the whole sweep is pipeline-offload-flux-auto, one call each)", "gpu",
             (OFFLOAD,), args=("--model", "flux", "--card-gib", "12", "--steps", "28", "--strategies",
                               "resident,omni-budget,diffusers-group,mmgp2", "--omni-budget", "auto,11GiB",
                               "--time-budget", _PIPELINE_SWEEP_TIME)),
    Scenario("pipeline-offload-flux-lossless", "pipeline_offload_bench",
             "FLUX.1-dev pipeline end to end (28 steps) on an emulated 12 GiB card: resident, omni with no budget, "
             "and compression=lossless with no budget and with max_device_memory=auto (#37: <= 9.5 s; #40: auto + "
             "lossless <= 7.5 s)", "gpu", (OFFLOAD,),
             args=("--model", "flux", "--card-gib", "12", "--steps", "28", "--strategies", "resident,omni",
                   "--omni-lossless", "none,auto", "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-flux-shapes", "auto_shapes_bench",
             "FLUX.1-dev pipeline on an emulated 12 GiB card, one max_device_memory=auto, then 10 calls of 4 steps "
             "from 512² to 2048² at batch 1 and 2, the shape growing and shrinking: each call's peak against the "
             "card, out-of-memory errors counted (#40's target)", "gpu", (),
             args=("--model", "flux", "--card-gib", "12", "--steps", "4", "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-flux-sweep", "pipeline_offload_bench",
             "FLUX.1-dev pipeline end to end (28 steps) on an emulated 12 GiB card: max_device_memory 4, 6, 9, 10 and "
             "11 GiB (with pipeline-offload-flux-auto's 8 GiB and auto: the budget sweep), a plot of end to end "
             "against the budget", "gpu", (),
             args=("--model", "flux", "--card-gib", "12", "--steps", "28", "--strategies", "resident",
                   "--omni-budget", _FLUX_SWEEP, "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-qwen", "pipeline_offload_bench",
             "Qwen-Image pipeline end to end (20 of its 50 steps) on an emulated 24 GiB card: omni (and with a 16 "
             "GiB budget) vs Diffusers' offloads vs mmgp", "gpu", (README, OFFLOAD),
             args=("--model", "qwen", "--card-gib", "24", "--steps", "20", "--strategies", _PIPELINE_QWEN,
                   "--omni-budget", "16GiB", "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-qwen-auto", "pipeline_offload_bench",
             "Qwen-Image pipeline end to end (20 of its 50 steps) on an emulated 24 GiB card: max_device_memory 12, 16 "
             "and 20 GiB and auto (its reading, choice and per-shape headroom recorded), a plot of end to end against "
             "the budget (#40: auto within 1.05 of the sweep's fastest)", "gpu", (OFFLOAD,),
             args=("--model", "qwen", "--card-gib", "24", "--steps", "20", "--strategies", "omni",
                   "--omni-budget", "12GiB,16GiB,20GiB,auto", "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-qwen-vae-room", "pipeline_offload_bench",
             "Qwen-Image pipeline, 20 steps, on an emulated 24 GiB card: max_device_memory=20GiB (whose image differed "
             "from the others' in pipeline-offload-qwen-auto, its VAE decode slower) against omni with no budget, "
             "after the VAE's room gained a quarter of its need as margin", "gpu", (OFFLOAD,),
             args=("--model", "qwen", "--card-gib", "24", "--steps", "20", "--strategies", "omni",
                   "--omni-budget", "20GiB", "--time-budget", "200")),
    Scenario("pipeline-offload-qwen-diffusers", "pipeline_offload_bench",
             "Qwen-Image pipeline, 20 steps, on an emulated 24 GiB card: Diffusers' sequential CPU offload (4 steps, "
             "scaled) and model CPU offload against resident", "gpu", (README, OFFLOAD),
             args=("--model", "qwen", "--card-gib", "24", "--steps", "20", "--strategies",
                   "resident,diffusers-sequential,diffusers-model", "--sequential-steps", "4",
                   "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-wan", "pipeline_offload_bench",
             "Wan2.2-T2V-A14B pipeline, 81 frames 480×832, 4 of its 40 steps, on an emulated 24 GiB card: omni "
             "(and with a 14 GiB budget) vs Diffusers' group offload", "gpu", (README, OFFLOAD),
             args=("--model", "wan", "--card-gib", "24", "--steps", "4", "--strategies", _PIPELINE_WAN,
                   "--omni-budget", "14GiB", "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-wan-auto", "pipeline_offload_bench",
             "Wan2.2-T2V-A14B pipeline, 81 frames 480×832, 4 of its 40 steps, on an emulated 24 GiB card: resident, "
             "omni and max_device_memory=auto (#40: auto within 1.02 of resident)", "gpu", (OFFLOAD,),
             args=("--model", "wan", "--card-gib", "24", "--steps", "4", "--strategies", "resident,omni",
                   "--omni-budget", "auto", "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-wan-host", "pipeline_offload_bench",
             "Wan2.2-T2V-A14B pipeline, 81 frames 480×832, 4 of its 40 steps, on an emulated 24 GiB card: omni "
             "with max_host_memory=32GiB (the experts saved to disk and read back, page cache dropped before every "
             "forward) against omni with every host copy pinned", "gpu", (OFFLOAD,),
             args=("--model", "wan", "--card-gib", "24", "--steps", "4", "--strategies", "omni,omni-host",
                   "--omni-host-budget", "32GiB", "--time-budget", _PIPELINE_TIME)),
    Scenario("pipeline-offload-wan-host-lossless", "pipeline_offload_bench",
             "Wan2.2-T2V-A14B pipeline, 81 frames 480×832, 2 of its 40 steps (timesteps 999 and 750: one per expert, "
             "the boundary at 875), on an emulated 24 GiB card, max_host_memory=32GiB, page cache dropped before "
             "every forward: blocks read from the checkpoint (omni-host) against blocks read coded from "
             "compression_cache_dir (omni-host-lossless, whose enable writes the cache; its DiTs stay as built, as "
             "the machine's disk holds the checkpoint or the cache, not both); two steps so that both runs fit one "
             "10-minute device call (the first forward of each expert is what #37 measures)", "gpu", (OFFLOAD,),
             args=("--model", "wan", "--card-gib", "24", "--steps", "2", "--strategies",
                   "omni-host,omni-host-lossless", "--omni-host-budget", "32GiB", "--host-lossless-from-memory",
                   "--time-budget", "540")),
    Scenario("pipeline-offload-wan-mmgp", "pipeline_offload_bench",
             "Wan2.2-T2V-A14B pipeline, 81 frames 480×832, 4 of its 40 steps, on an emulated 24 GiB card: mmgp's "
             "profiles 2 and 4 against resident", "gpu", (README, OFFLOAD),
             args=("--model", "wan", "--card-gib", "24", "--steps", "4", "--strategies", "resident,mmgp2,mmgp4",
                   "--time-budget", _PIPELINE_TIME)),
    Scenario("disk-read-probe", "disk_read_probe",
             "cold read bandwidth of the machine's disk, one reader and several in parallel (max_host_memory's reads)",
             "gpu", (OFFLOAD,), args=("--size-gib", "8")),
    # Interop -----------------------------------------------------------------------------------------------------
    Scenario("diffusers-pipeline-tests", "diffusers_pipeline_tests",
             "Diffusers' own fast pipeline tests with the Omni classes and offload (give a Diffusers checkout)",
             "cpu", (INTEROP,), out="file", smoke=None, merges_previous=True),
)

_BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
_SUITE_OWNER = {suite: scenario for scenario in SCENARIOS for suite in scenario.suites}
SUITES: tuple[str, ...] = tuple(_SUITE_OWNER)


def get(name: str) -> Scenario:
    """The scenario called ``name``; a ``KeyError`` naming every scenario otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no benchmark scenario {name!r}; scenarios: {', '.join(_BY_NAME)}") from None


def owner(suite: str) -> Scenario:
    """The scenario that writes ``suite``."""
    try:
        return _SUITE_OWNER[suite]
    except KeyError:
        raise KeyError(f"no results suite {suite!r}; suites: {', '.join(SUITES)}") from None
