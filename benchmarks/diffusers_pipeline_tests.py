"""Diffusers' own fast pipeline tests, run against the Omni classes with offload enabled in their setup (issue #28).

Usage (``DIFFUSERS_SRC`` is a checkout of github.com/huggingface/diffusers; only its ``tests/`` is used, against the
installed Diffusers)::

    python -m benchmarks run diffusers-pipeline-tests -- /tmp/diffusers-src --modes stock layerwise model_level

Diffusers' tests import ``parameterized`` and ``requests_mock`` (its test extras, not installed here): without them
most test files fail at collection in every mode, so the driver stops first (``TEST_MODULES``); install them apart,
e.g. ``pip install --target DIR parameterized requests-mock`` and ``DIR`` on ``PYTHONPATH``. ``--compare-with
latest.json`` compares a (partial) run with the committed one on the same test files.

Modes:

- ``stock``: Diffusers' classes, as Diffusers runs them.
- ``omni``: the Omni class of each test's ``pipeline_class`` (omni attention as the class sets it up), no offload.
- ``layerwise`` / ``model_level``: the Omni class, with ``enable_layerwise_offload(device="cpu")`` /
  ``enable_model_level_offload(device="cpu")`` called at the end of every construction, so every pipeline a test
  builds (``pipeline_class(**components)``, ``from_pretrained``, ``from_pipe``) starts offloaded. A second pipeline
  built from the same components therefore enables the same offload again, which adopts it.

Only test classes whose ``pipeline_class`` is a Diffusers pipeline diffusers-omni serves (``FAMILY_OF``) are kept,
in every mode, so the counts compare the same tests. The script is also the pytest plugin it loads into each run
(``-p benchmarks.diffusers_pipeline_tests``); it is not collected by this repository's test run (no ``test_`` name).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

MODES = ("stock", "omni", "layerwise", "model_level")
_MODE_ENV = "OMNI_DPT_MODE"
_REPORT_ENV = "OMNI_DPT_REPORT"

# Diffusers' test folders (under tests/pipelines) holding the families diffusers-omni serves; files under pag/
# are filtered to the SD3 / SDXL ones.
FAMILY_TEST_PATHS: dict[str, tuple[str, ...]] = {
    "flux": ("flux",),
    "flux2": ("flux2",),
    "wan": ("wan",),
    "qwenimage": ("qwenimage",),
    "sd3": ("stable_diffusion_3", "pag/test_pag_sd3.py", "pag/test_pag_sd3_img2img.py"),
    "sdxl": ("stable_diffusion_xl", "pag/test_pag_sdxl.py", "pag/test_pag_sdxl_img2img.py",
             "pag/test_pag_sdxl_inpaint.py"),
    "hunyuanvideo15": ("hunyuan_video1_5",),
    "ltx2": ("ltx2",),
    "zimage": ("z_image",),
    "chroma": ("chroma",),
    "longcat": ("longcat_image",),
    "ovis": ("ovis_image",),
    "cosmos3": ("cosmos",),
}
# The main (text-to-image / text-to-video) test file of each family, for a run that fits a small CPU budget.
# LongCat has none: Diffusers' longcat_image tests hold no test class of the pipelines served here.
REPRESENTATIVE: dict[str, tuple[str, ...]] = {
    "chroma": ("chroma/test_pipeline_chroma.py",),
    "cosmos3": ("cosmos/test_cosmos3.py",),
    "flux2": ("flux2/test_pipeline_flux2.py",),
    "hunyuanvideo15": ("hunyuan_video1_5/test_hunyuan_1_5.py",),
    "ltx2": ("ltx2/test_ltx2.py",),
    "ovis": ("ovis_image/test_ovis_image.py",),
    "zimage": ("z_image/test_z_image.py",),
    "flux": ("flux/test_pipeline_flux.py",),
    "wan": ("wan/test_wan.py",),
    "qwenimage": ("qwenimage/test_qwenimage.py",),
    "sd3": ("stable_diffusion_3/test_pipeline_stable_diffusion_3.py",),
    "sdxl": ("stable_diffusion_xl/test_stable_diffusion_xl.py",),
}


# ---------------------------------------------------------------------------------------------------------------
# pytest plugin side (runs inside the pytest subprocess)

_SWAPPED: dict[type, type] = {}


def _offloaded_class(omni_cls: type, mode: str) -> type:
    """A subclass of ``omni_cls`` (same name) that enables ``mode``'s offload at the end of construction."""

    @functools.wraps(omni_cls.__init__)  # Diffusers reads the component names from the signature
    def __init__(self, *args, **kwargs):  # noqa: N807
        omni_cls.__init__(self, *args, **kwargs)
        if not self.omni_dits():
            # A pipeline built without its DiT (test_encode_prompt_works_in_isolation builds one from the text
            # encoders alone) has nothing to offload; it shares the encoders with the offloaded pipeline and runs
            # as is.
            return
        if mode == "layerwise":
            self.enable_layerwise_offload(device="cpu")
        else:
            self.enable_model_level_offload(device="cpu")

    return type(omni_cls.__name__, (omni_cls,), {"__init__": __init__, "__module__": omni_cls.__module__,
                                                 "__qualname__": omni_cls.__qualname__})


def _swap(diffusers_cls: type, mode: str) -> type:
    from diffusers_omni.pipelines.registry import omni_class_for

    if diffusers_cls not in _SWAPPED:
        omni_cls = omni_class_for(diffusers_cls.__name__)
        _SWAPPED[diffusers_cls] = omni_cls if mode == "omni" else _offloaded_class(omni_cls, mode)
    return _SWAPPED[diffusers_cls]


def _served(cls: type | None) -> bool:
    from diffusers_omni.pipelines.registry import FAMILY_OF

    pipeline_class = getattr(cls, "pipeline_class", None)
    return isinstance(pipeline_class, type) and (pipeline_class.__name__ in FAMILY_OF
                                                 or pipeline_class in _SWAPPED.values())


def pytest_collection_modifyitems(session, config, items):  # noqa: ARG001 - pytest hook signature
    mode = os.environ.get(_MODE_ENV, "stock")
    if mode not in MODES:
        raise ValueError(f"{_MODE_ENV}={mode!r}: expected one of {', '.join(MODES)}")
    kept, dropped = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        if not _served(cls):
            dropped.append(item)
            continue
        kept.append(item)
        if mode != "stock" and cls.pipeline_class not in _SWAPPED.values():
            cls.pipeline_class = _swap(cls.pipeline_class, mode)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


_OUTCOMES: dict[str, str] = {}
_ERRORS: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = report.outcome
        if report.when == "setup" and report.failed:
            outcome = "error"
        _OUTCOMES[report.nodeid] = outcome
        if report.failed:
            text = str(report.longrepr.reprcrash.message) if hasattr(report.longrepr, "reprcrash") else str(
                report.longrepr)
            _ERRORS[report.nodeid] = text.splitlines()[0][:300] if text else ""
    elif report.when == "teardown" and report.failed:
        _OUTCOMES[report.nodeid] = "error"
        _ERRORS.setdefault(report.nodeid, str(report.longrepr).splitlines()[-1][:300])


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pytest hook signature
    path = os.environ.get(_REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps({"outcomes": _OUTCOMES, "errors": _ERRORS}, indent=1))


# ---------------------------------------------------------------------------------------------------------------
# driver side

# Hub repositories Diffusers' dummy components load tokenizers / configs from. Without network access (this machine
# reaches only PyPI) they are built locally and saved under ``<hub>/<repo id>``; the tests run with ``<hub>`` as the
# working directory, so ``from_pretrained("hf-internal-testing/…")`` finds the local folder. The stand-ins are
# not the hub's files (tests asserting hard-coded output slices fail in every mode alike); every mode uses the same.
STAND_INS = ("hf-internal-testing/tiny-random-t5", "hf-internal-testing/tiny-random-clip",
             "hf-internal-testing/tiny-random-Qwen2VLForConditionalGeneration", "hf-internal-testing/tiny-gemma3",
             "hf-internal-testing/tiny-cosmos3-modular-pipe")

# Modules Diffusers' test files import that are not Diffusers' own dependencies.
TEST_MODULES = ("parameterized", "requests_mock")


def missing_test_modules() -> list[str]:
    import importlib.util

    return [name for name in TEST_MODULES if importlib.util.find_spec(name) is None]


def make_stand_ins(hub: Path) -> list[str]:
    """Build the ``STAND_INS`` under ``hub`` (tokenizers and LTX-2's tiny Gemma 3 from ``diffusers_omni.testing``;
    T5's config as the hub's tiny-random-t5: d_model 32, 5 layers, 4 heads); returns the repo ids written."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig, T5Config

    from diffusers_omni.testing.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer
    from diffusers_omni.testing.tiny_cosmos3 import tiny_cosmos3_tokenizer
    from diffusers_omni.testing.tiny_ltx2 import tiny_gemma_tokenizer
    from diffusers_omni.testing.tiny_qwenimage import tiny_qwen2_tokenizer

    t5, clip, qwen, gemma, cosmos = (hub / repo for repo in STAND_INS)
    tokenizer = tiny_t5_tokenizer()
    tokenizer.save_pretrained(t5)
    T5Config(vocab_size=1103, d_model=32, d_kv=8, d_ff=37, num_layers=5, num_decoder_layers=5, num_heads=4,
             relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
             eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id).save_pretrained(t5)
    tiny_clip_tokenizer().save_pretrained(clip)
    # Tokenizer only: Qwen2VLProcessor.from_pretrained needs a video processor, which needs torchvision (absent
    # here), so the Edit tests that load a processor fail in every mode alike.
    tiny_qwen2_tokenizer().save_pretrained(qwen)
    # LTX-2's tests load a tiny Gemma 3 (tokenizer and weights) and size their connectors from its config; Cosmos 3's
    # load only the text tokenizer of a modular pipeline (the one diffusers-omni's own tests build).
    tokenizer = tiny_gemma_tokenizer()
    tokenizer.save_pretrained(gemma)
    # Hidden size 32: the tests' connectors (4 heads × 8) take the encoder's hidden size as their width.
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=8,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                mm_tokens_per_image=4)).save_pretrained(gemma)
    tiny_cosmos3_tokenizer().save_pretrained(cosmos / "text_tokenizer")
    return list(STAND_INS)


def _test_paths(src: Path, families: list[str], representative: bool = False,
                files: list[str] | None = None) -> list[str]:
    if files:  # given explicitly (relative to tests/pipelines)
        return [str(src / "tests" / "pipelines" / rel) for rel in files]
    paths = []
    for family in families:
        for rel in (REPRESENTATIVE if representative else FAMILY_TEST_PATHS)[family]:
            path = src / "tests" / "pipelines" / rel
            if path.exists():
                paths.append(str(path))
    return paths


def run_mode(src: Path, mode: str, families: list[str], timeout: int, report: Path, hub: Path,
             representative: bool = False, files: list[str] | None = None) -> dict:
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, _MODE_ENV: mode, _REPORT_ENV: str(report),
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.diffusers_pipeline_tests",
           "--continue-on-collection-errors", "--rootdir", str(src), *_test_paths(src, families, representative, files)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=hub, env=env, capture_output=True, text=True, timeout=timeout)
        tail, timed_out = proc.stdout[-3000:], False
    except subprocess.TimeoutExpired as exc:
        tail, timed_out = (exc.stdout or b"")[-3000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-3000:], True
    seconds = time.time() - t0
    data = json.loads(report.read_text()) if report.exists() else {"outcomes": {}, "errors": {}}
    counts: dict[str, int] = {}
    for outcome in data["outcomes"].values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"mode": mode, "seconds": round(seconds), "timed_out": timed_out, "counts": counts,
            "outcomes": data["outcomes"], "errors": data["errors"],
            "tail": tail if isinstance(tail, str) else tail.decode(errors="replace")}


def summarize(runs: dict[str, dict]) -> dict:
    stock_ok = {k for k, v in runs.get("stock", {}).get("outcomes", {}).items() if v == "passed"}
    for mode, run in runs.items():
        run["counts"] = {}
        for outcome in run["outcomes"].values():
            run["counts"][outcome] = run["counts"].get(outcome, 0) + 1
        failed = sorted(k for k, v in run["outcomes"].items() if v in ("failed", "error"))
        run["failures"] = {k: run.get("errors", run.get("failures", {})).get(k, "") for k in failed}
        run.pop("errors", None)
        run["beyond_stock"] = sorted(k for k in failed if k in stock_ok) if mode != "stock" else []
    return runs


def compare(now: dict, committed: dict) -> dict:
    """Each mode of ``now`` against the same mode of ``committed`` (a result, with or without its meta block),
    restricted to the test files ``now`` ran: counts on both sides, the ids only one side has, and every id whose
    outcome differs (with the committed stock outcome, where there is one, and both sides' error lines)."""
    now, committed = now.get("payload", now), committed.get("payload", committed)
    stock = committed["runs"].get("stock", {}).get("outcomes", {})
    out = {}
    for mode, run in now["runs"].items():
        files = tuple(f"{path}::" for path in run.get("files", []))
        before = committed["runs"].get(mode, {})
        old = {k: v for k, v in before.get("outcomes", {}).items() if k.startswith(files)}
        new = run["outcomes"]

        def counts(outcomes: dict) -> dict:
            return {o: sum(v == o for v in outcomes.values()) for o in ("passed", "failed", "skipped", "error")}

        out[mode] = {"counts_now": counts(new), "counts_committed": counts(old),
                     "committed_commit": before.get("commit", committed.get("commit", "")),
                     "only_now": sorted(set(new) - set(old)), "only_committed": sorted(set(old) - set(new)),
                     "differences": [{"test": k, "now": new[k], "committed": old[k], "stock_committed": stock.get(k),
                                      "error_now": run.get("failures", {}).get(k, ""),
                                      "error_committed": before.get("failures", {}).get(k, "")}
                                     for k in sorted(set(new) & set(old)) if new[k] != old[k]]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a checkout of huggingface/diffusers (its tests/ is run)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["stock", "layerwise", "model_level"])
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILY_TEST_PATHS), default=sorted(FAMILY_TEST_PATHS))
    parser.add_argument("--representative", action="store_true",
                        help=f"only the main test file of {', '.join(REPRESENTATIVE)} (see REPRESENTATIVE)")
    parser.add_argument("--files", nargs="+", default=None,
                        help="test files relative to tests/pipelines, instead of the families' (--families then only "
                             "labels the run)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per mode")
    parser.add_argument("--source-ref", default="", help="which Diffusers revision the tests come from (recorded)")
    parser.add_argument("--hub", type=Path, default=Path("/tmp/omni-dpt-hub"),
                        help="folder for the local stand-ins of the hub repositories the tests load (built if absent)")
    parser.add_argument("--merge", nargs="+", type=Path, default=[],
                        help="result files of separate runs (e.g. one per mode, run in parallel) to merge into --out")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (merged into an existing file)")
    parser.add_argument("--compare-with", type=Path, default=None,
                        help="a committed result (e.g. results/diffusers-pipeline-tests/latest.json): each mode's "
                             "outcomes are compared with it, on the same test files (recorded as 'comparison')")
    args = parser.parse_args(argv)
    if not (args.src / "tests" / "pipelines" / "test_pipelines_common.py").exists():
        parser.error(f"src={str(args.src)!r}: no tests/pipelines/test_pipelines_common.py there; "
                     "give a checkout of huggingface/diffusers")
    if args.modes and not args.merge and (missing := missing_test_modules()):
        parser.error(f"Diffusers' tests import {', '.join(missing)}, not installed: install them (e.g. pip install "
                     f"--target DIR {' '.join(m.replace('_', '-') for m in missing)}, DIR on PYTHONPATH)")

    import diffusers
    import torch

    previous = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
    runs = dict(previous.get("runs", {}))
    for path in args.merge:  # runs of one mode from several files (e.g. two family sets) are combined
        merged = json.loads(path.read_text())
        for mode, run in merged["runs"].items():
            if mode not in runs:
                runs[mode] = run
                continue
            into = runs[mode]
            into["outcomes"] = {**into["outcomes"], **run["outcomes"]}
            into["failures"] = {**into.get("failures", {}), **run.get("failures", {})}
            into["families"] = into["families"] + [f for f in run["families"] if f not in into["families"]]
            into["files"] = into.get("files", []) + [f for f in run.get("files", []) if f not in into.get("files", [])]
            into["seconds"] += run["seconds"]
            into["timed_out"] = into["timed_out"] or run["timed_out"]
        previous.setdefault("diffusers_tests_ref", merged.get("diffusers_tests_ref", ""))
    if args.merge:
        args.modes = []
    if not all((args.hub / repo).is_dir() for repo in STAND_INS):
        make_stand_ins(args.hub)
    for mode in args.modes:
        report = Path(os.environ.get("TMPDIR", "/tmp")) / f"omni_dpt_{mode}_{os.getpid()}.json"
        report.unlink(missing_ok=True)
        if args.representative:
            args.families = [family for family in args.families if family in REPRESENTATIVE]
        run = run_mode(args.src, mode, args.families, args.timeout, report, args.hub, args.representative, args.files)
        run["families"] = args.families
        run["files"] = [str(Path(path).relative_to(args.src))
                        for path in _test_paths(args.src, args.families, args.representative, args.files)]
        runs[mode] = run
        print(f"{mode}: {run['counts']} in {run['seconds']} s{' (timed out)' if run['timed_out'] else ''}",
              flush=True)
    runs = summarize(runs)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True).stdout.strip()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "diffusers": diffusers.__version__, "torch": torch.__version__, "python": platform.python_version(),
              "diffusers_tests_ref": args.source_ref or previous.get("diffusers_tests_ref", ""),
              "commit": commit, "device": "cpu", "hub_stand_ins": list(STAND_INS), "runs": runs}
    for mode, run in runs.items():
        print(f"{mode}: {run['counts']}; beyond stock: {len(run['beyond_stock'])}")
        for nodeid in run["beyond_stock"]:
            print(f"  {nodeid}: {run['failures'][nodeid]}")
    if args.compare_with:
        result["comparison"] = compare(result, json.loads(args.compare_with.read_text()))
        for mode, diff in result["comparison"].items():
            print(f"{mode}: now {diff['counts_now']}, committed {diff['counts_committed']}; "
                  f"{len(diff['differences'])} differ, {len(diff['only_now'])} only now, "
                  f"{len(diff['only_committed'])} only committed")
            for d in diff["differences"]:
                print(f"  {d['test']}: {d['committed']} -> {d['now']} (stock {d['stock_committed']}) {d['error_now']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
