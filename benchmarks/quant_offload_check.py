#!/usr/bin/env python
"""Quantized offload correctness on CUDA: every format (torchao float8/int8, GGUF Q8_0/Q4_K, bitsandbytes NF4 with
double quant and int8) on tiny FLUX and Wan transformers, under every strategy (model-level, layerwise, layerwise
with ``max_device_memory``, distributed layerwise on a one-rank NCCL group with and without AllGather), enabled
from host weights and from device weights; plus pipelines loaded with Diffusers' ``PipelineQuantizationConfig``
(bitsandbytes 4-bit transformer and text encoder). Each check compares with the resident quantized model bit for
bit, step after step, and checks the weights after ``disable()``. Writes ``<out>.json``.

    python -m benchmarks run quant-offload-check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from benchmarks.quant_offload_bench import build_model, make_inputs, quantize, versions

FORMATS = ("torchao-float8", "torchao-int8", "gguf-q8_0", "gguf-q4_k", "bnb-nf4", "bnb-int8")


def _quantize(model, fmt, device):
    if fmt == "bnb-int8":
        from diffusers_omni.testing.quantized import bnb_quantize_

        bnb_quantize_(model, bits=8)
        return {"detail": "Linear8bitLt"}
    return quantize(model, fmt, device)


def move(model, device) -> None:
    """``model.to(device)``, plus each bitsandbytes ``Linear8bitLt``'s own ``.to()``: a parent's ``.to()`` moves the
    ``Int8Params`` but not the ``Linear8bitLt.state`` tensors its forward reads (bitsandbytes 0.50), so without it a
    round trip leaves them behind (the 2026-12-03 H200 check failed every bnb-int8 scenario there, after
    ``disable()``, in ``model.to(device)`` then a resident run)."""
    for module in model.modules():
        if type(module).__name__ == "Linear8bitLt":
            module.to(device)
    model.to(device)


def _run(model, inputs, steps=2):
    with torch.inference_mode():
        return [model(**inputs)[0].clone() for _ in range(steps)]


def _state(model):
    return {n: (p, type(p)) for n, p in model.named_parameters()}


def check_model(name: str, fmt: str, device: torch.device, fresh_only: bool = False) -> dict:
    from diffusers_omni import OffloadConfig, apply_offload
    from diffusers_omni.offload.memory import PackedWeights

    model = build_model(name, device, smoke=True)
    _quantize(model, fmt, device)
    inputs = make_inputs(name, model, device, smoke=True)
    reference = _run(model, inputs)
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    block_modules = (list(model.transformer_blocks) + list(model.single_transformer_blocks)) if name == "flux" \
        else list(model.blocks)

    def budget_config() -> OffloadConfig:
        # From the model as it is now: a bitsandbytes 8-bit model on the host holds other tensors than on the
        # device (its Linear8bitLt state), so a budget sized on the device can be below what the host layout needs.
        largest = max(PackedWeights("", b).nbytes for b in block_modules)
        packed = PackedWeights("", model)
        resident_bytes = sum(packed.numel.get(d, 0) * d.itemsize for d in packed.numel)
        return OffloadConfig("layerwise", device=device, max_device_memory=resident_bytes // 2 + 3 * largest)

    strategies = {
        "model_level": OffloadConfig("model_level", device=device),
        "layerwise": OffloadConfig("layerwise", device=device, max_device_memory="none"),
        "layerwise_budget": budget_config(),
        "distributed_allgather": OffloadConfig("distributed_layerwise", device=device),
        "distributed_no_allgather": OffloadConfig("distributed_layerwise", device=device, use_allgather=False),
    }
    results = {"kinds": kinds}
    for label in ("layerwise", "model_level"):  # a fresh model, never moved with .to(): offload alone
        key = f"{label} fresh from device"
        phase = "build"
        try:
            fresh = build_model(name, device, smoke=True)
            _quantize(fresh, fmt, device)
            expected = _run(fresh, inputs)
            phase = "enable"
            backend = apply_offload(fresh, strategies[label])
            phase = "offloaded run"
            out = _run(fresh, inputs)
            phase = "disable"
            backend.disable()
            phase = "move back and resident run"
            move(fresh, device)
            again = _run(fresh, inputs)
            results[key] = {"equal": all(torch.equal(a, b) for a, b in zip(expected, out)),
                            "equal_after_disable": all(torch.equal(a, b) for a, b in zip(expected, again))}
            del fresh
        except Exception as error:  # noqa: BLE001 - reported
            results[key] = {"error": f"{phase}: {type(error).__name__}: {error}",
                            "traceback": traceback.format_exc()[-2000:]}
        print(f"{name}/{fmt}/{key}: {results[key] if 'error' not in results[key] else results[key]['error']}",
              flush=True)
    if fresh_only:
        return results
    for start in ("host", "device"):
        for label, config in strategies.items():
            key = f"{label} from {start}"
            phase, backend = "move", None
            try:
                move(model, "cpu" if start == "host" else device)
                if label == "layerwise_budget":
                    config = budget_config()
                before = _state(model)
                phase = "enable"
                backend = apply_offload(model, config)
                phase = "offloaded run"
                out = _run(model, inputs)
                equal = all(torch.equal(a, b) for a, b in zip(reference, out))
                stats = backend.stats
                phase = "disable"
                backend.disable()
                after = _state(model)
                # Block weights come back as the same objects when they started on the host; weights the offload
                # moved to the device (non-block ones under layerwise, everything from the device) are rebuilt.
                blocks = [n for n in before if _in_blocks(n)]
                same_objects = all(after[n][0] is before[n][0] for n in blocks) if start == "host" else None
                same_types = all(after[n][1] is before[n][1] for n in before)
                on_host = all(p.device.type == "cpu" for n, p in model.named_parameters() if _in_blocks(n))
                phase = "move back and resident run"
                move(model, device)
                again = all(torch.equal(a, b) for a, b in zip(reference, _run(model, inputs)))
                results[key] = {"equal": equal, "equal_after_disable": again, "same_block_objects": same_objects,
                                "same_types": same_types, "blocks_on_host_after_disable": on_host,
                                "streamed_bytes": getattr(stats, "streamed_bytes_per_pass", None),
                                "resident_blocks": getattr(stats, "resident_blocks", None),
                                "max_in_flight_bytes": getattr(stats, "max_in_flight_bytes", None)}
            except Exception as error:  # noqa: BLE001 - reported
                results[key] = {"error": f"{phase}: {type(error).__name__}: {error}",
                                "traceback": traceback.format_exc()[-2000:]}
                if backend is not None and backend.is_enabled():
                    backend.disable()  # or every later scenario fails on this one's hooks and guards
            print(f"{name}/{fmt}/{key}: {results[key] if 'error' not in results[key] else results[key]['error']}",
                  flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def _in_blocks(name: str) -> bool:
    return name.startswith(("transformer_blocks", "single_transformer_blocks", "blocks"))


PIPELINE_CHECKS = ("equal", "lora_changes_output", "lora_equal", "unloaded_equal")


def _save_lora(pipe, folder: str) -> None:
    """A LoRA on the attention projections of ``pipe``'s transformer, saved in Diffusers' format."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    source = type(pipe.transformer).from_config(pipe.transformer.config)
    torch.manual_seed(1)
    source.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                  target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    type(pipe).save_lora_weights(folder, transformer_lora_layers=get_peft_model_state_dict(source))


def check_pipeline(device: torch.device) -> dict:
    """A tiny FLUX pipeline saved and loaded back with PipelineQuantizationConfig (bitsandbytes 4-bit transformer
    and T5 encoder): model-level and layerwise offload against the resident pipeline, then a LoRA loaded and
    unloaded with the offload on against the resident pipeline with the same LoRA."""
    from diffusers import BitsAndBytesConfig, PipelineQuantizationConfig
    from transformers import BitsAndBytesConfig as TransformersBitsAndBytesConfig

    from diffusers_omni.pipelines.flux import OmniFluxPipeline
    from diffusers_omni.testing.tiny import tiny_flux_pipeline

    results = {}
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as lora:
        tiny = tiny_flux_pipeline(pipeline_cls=OmniFluxPipeline)
        tiny.save_pretrained(folder)
        _save_lora(tiny, lora)
        kwargs = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                      bnb_4bit_compute_dtype=torch.float32)
        config = PipelineQuantizationConfig(quant_mapping={
            "transformer": BitsAndBytesConfig(**kwargs), "text_encoder_2": TransformersBitsAndBytesConfig(**kwargs)})

        def generate(pipe):
            generator = torch.Generator("cpu").manual_seed(0)
            return pipe(prompt="a fox", num_inference_steps=2, height=32, width=32, generator=generator,
                        output_type="latent", max_sequence_length=32)[0]

        for label in ("model_level", "layerwise"):
            phase = "load"
            try:
                pipe = OmniFluxPipeline.from_pretrained(folder, quantization_config=config)
                results["kinds"] = sorted({type(p).__name__ for p in pipe.transformer.parameters()})
                phase = "resident reference"
                pipe.to(device)
                reference = generate(pipe)
                pipe.load_lora_weights(lora)
                reference_lora = generate(pipe)
                pipe.unload_lora_weights()
                phase = "offloaded run"
                pipe = OmniFluxPipeline.from_pretrained(folder, quantization_config=config)
                if label == "model_level":
                    pipe.enable_model_level_offload(device=device)
                else:
                    pipe.enable_layerwise_offload(device=device, max_device_memory="none")
                out = generate(pipe)
                phase = "LoRA loaded with the offload on"
                pipe.load_lora_weights(lora)
                out_lora = generate(pipe)
                phase = "LoRA unloaded with the offload on"
                pipe.unload_lora_weights()
                out_unloaded = generate(pipe)
                pipe.disable_omni_offload()
                results[label] = {"equal": bool(torch.equal(out, reference)),
                                  "lora_changes_output": not torch.equal(reference_lora, reference),
                                  "lora_equal": bool(torch.equal(out_lora, reference_lora)),
                                  "unloaded_equal": bool(torch.equal(out_unloaded, reference))}
            except Exception as error:  # noqa: BLE001 - reported
                results[label] = {"error": f"{phase}: {type(error).__name__}: {error}",
                                  "traceback": traceback.format_exc()[-2000:],
                                  "execution_device": str(getattr(locals().get("pipe"), "_execution_device", None)),
                                  "backend": type(getattr(locals().get("pipe"), "omni_offload_backend", None)).__name__}
            print(f"pipeline/{label}: {results[label]}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json (the runner, python -m benchmarks run, chooses it)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only dry-runs the script (gloo, no pipeline)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--models", default="flux,wan")
    parser.add_argument("--fresh-only", action="store_true", help="only the fresh-model scenarios")
    parser.add_argument("--skip-pipeline", action="store_true", help="no PipelineQuantizationConfig pipeline check")
    args = parser.parse_args()
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    report = {"versions": versions(), "torch": torch.__version__, "device": str(device) if device.type == "cpu"
              else torch.cuda.get_device_name(device),
              "models": {}}
    out = Path(args.out).with_suffix(".json")
    for name in args.models.split(","):
        for fmt in args.formats.split(","):
            try:
                report["models"][f"{name}/{fmt}"] = check_model(name, fmt, device, args.fresh_only)
            except Exception as error:  # noqa: BLE001 - reported
                report["models"][f"{name}/{fmt}"] = {"error": f"{type(error).__name__}: {error}",
                                                     "traceback": traceback.format_exc()[-2000:]}
                print(f"{name}/{fmt}: {error}", flush=True)
            out.write_text(json.dumps(report, indent=2, default=str))  # partial: a later failure keeps this
    report["pipeline"] = check_pipeline(device) if device.type == "cuda" and not args.skip_pipeline else {}
    failures = [f"{m}/{k}" for m, r in report["models"].items() for k, v in r.items()
                if isinstance(v, dict) and ("error" in v or not v.get("equal") or not v.get("equal_after_disable"))]
    failures += [f"pipeline/{k}" for k, v in report["pipeline"].items()
                 if isinstance(v, dict) and ("error" in v or not all(v.get(c) for c in PIPELINE_CHECKS))]
    report["failures"] = failures
    out.write_text(json.dumps(report, indent=2, default=str))
    print("failures:", failures or "none", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
