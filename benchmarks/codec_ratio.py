"""What ``compression="lossless"`` saves on trained weights against random ones (issue #37: "the ratio on random
weights and on trained weights, both stated"), on the CPU.

No model hub is reachable where this runs, so the trained weights are the ones small PyPI packages ship inside their
wheels (``--files``: TorchScript ``.jit``/``.pt``, ``.safetensors`` or ONNX ``.onnx`` files; ONNX needs the ``onnx``
package). Each file's floating-point tensors are cast to bfloat16 (the distribution of a trained model's values,
rounded as a bf16 checkpoint of it would be), concatenated into one buffer as a streamed block's are, and coded with
``offload.codec``. Reported per file: weights, the exponent's entropy, the ideal size of a code that stores the sign
and mantissa as they are and the exponent at its entropy ((1 + 7 + H) / 16 of bf16), the code's size, its width and
escapes. Random references: normal weights at the scales DiT initialisations use.

With ``--dfloat11-wheel`` (the ``dfloat11`` wheel from PyPI, and its ``dahuffman`` dependency importable), every
buffer is also coded by DFloat11's own encoder (its ``dfloat11_utils``: a Huffman code of the exponents, 32-bit
lookup tables, per-thread gaps and output positions, as its checkpoints store them), read from inside the wheel (its
package imports CuPy at import, which a CPU machine has not; the encoder itself needs only torch, NumPy and
dahuffman). Reported: its bytes against bf16 and its encoding time per million weights on this machine's CPU (one
core, as ``compress_model`` runs per process), which says how long coding a model in DFloat11's format takes.
DFloat11's decode kernel needs CUDA (a PTX module loaded through CuPy), so its decode is not run here.

Usage (the committed run: the weight files of two PyPI wheels, read from inside the wheels)::

    pip download --no-deps -d /tmp/wheels silero-vad==6.2.3 rapidocr-onnxruntime==1.4.4
    pip download --no-deps -d /tmp/df11 dfloat11==0.5.0
    pip install --target /tmp/onnx onnx dahuffman==0.4.2   # reads the .onnx files; DFloat11's encoder
    PYTHONPATH=/tmp/onnx python -m benchmarks run codec-ratio -- --wheels /tmp/wheels/*.whl \
        --dfloat11-wheel /tmp/df11/dfloat11-0.5.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from types import ModuleType

import torch

from diffusers_omni.offload import codec

WEIGHT_SUFFIXES = (".jit", ".pt", ".pth", ".safetensors", ".onnx")


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a weight file."""
    suffix = path.suffix.lower()
    if suffix in (".jit", ".pt") and _is_torchscript(path):
        module = torch.jit.load(str(path), map_location="cpu")
        tensors = {name: t for name, t in module.state_dict().items()}
    elif suffix in (".pt", ".pth", ".bin"):
        tensors = torch.load(str(path), map_location="cpu", weights_only=True)
    elif suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    elif suffix == ".onnx":
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
        arrays = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
        for node in model.graph.node:  # weights exported as Constant nodes
            if node.op_type == "Constant":
                for attribute in node.attribute:
                    if attribute.name == "value":
                        arrays[node.output[0]] = numpy_helper.to_array(attribute.t)
        tensors = {name: torch.from_numpy(array.copy()) for name, array in arrays.items() if array.dtype.kind == "f"}
    else:
        raise SystemExit(f"--files: {path} is not a .jit, .pt, .pth, .bin, .safetensors or .onnx file")
    return {name: t for name, t in tensors.items() if t.is_floating_point() and t.numel() > 0}


def _is_torchscript(path: Path) -> bool:
    try:
        torch.jit.load(str(path), map_location="cpu")
    except Exception:  # noqa: BLE001 - not TorchScript: a plain checkpoint
        return False
    return True


def measure(values: torch.Tensor) -> dict:
    """Code one bf16 buffer; its entropy-ideal size beside the code's."""
    flat = values.reshape(-1).to(torch.bfloat16)
    key = ((flat.view(torch.int16) >> 7) & 0xFF).to(torch.int64)
    counts = torch.bincount(key, minlength=256).double()
    p = counts[counts > 0] / flat.numel()
    entropy = float(-(p * p.log2()).sum())
    encoded = codec.encode(flat)
    assert torch.equal(codec.decode(encoded, use_kernel=False).view(torch.int16), flat.view(torch.int16))
    return {
        "weights": flat.numel(),
        "exponent_entropy_bits": entropy,
        "ideal_ratio": (8 + entropy) / 16,
        "ratio": encoded.nbytes / (2 * flat.numel()),
        "width": encoded.width,
        "escape_share": encoded.escapes.numel() / flat.numel(),
        "bitwise": True,
    }


def load_dfloat11_encoder(wheel: Path, scratch: Path) -> tuple[ModuleType, str]:
    """DFloat11's encoder (``dfloat11/dfloat11_utils.py``) read from inside its wheel, and the wheel's version."""
    with zipfile.ZipFile(wheel) as archive:
        member = next((m for m in archive.namelist() if m.endswith("dfloat11/dfloat11_utils.py")), None)
        if member is None:
            raise SystemExit(f"--dfloat11-wheel: {wheel} holds no dfloat11/dfloat11_utils.py; allowed: the dfloat11 "
                             "wheel from PyPI")
        path = Path(archive.extract(member, scratch))
    spec = importlib.util.spec_from_file_location("dfloat11_encoder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    version = wheel.name.split("-")[1] if wheel.name.count("-") >= 2 else "?"
    return module, version


# What DFloat11's checkpoints and its own ``compress_model`` use (dfloat11.py of the 0.5.0 wheel).
DFLOAT11_BYTES_PER_THREAD = 8
DFLOAT11_THREADS_PER_BLOCK = 512


def measure_dfloat11(encoder: ModuleType, values: torch.Tensor) -> dict:
    """Code one bf16 buffer with DFloat11's encoder: its stored bytes (the buffers its checkpoints hold per block)
    against bf16, and the encoding time."""
    flat = values.reshape(-1).to(torch.bfloat16)
    start = time.perf_counter()
    _, counter = encoder.get_codec(flat)
    code, _, table = encoder.get_32bit_codec(counter)
    luts = encoder.get_luts(table)
    encoded, sign_mantissa, positions, gaps, splits = encoder.encode_weights(
        [flat], code, DFLOAT11_BYTES_PER_THREAD, DFLOAT11_THREADS_PER_BLOCK)
    seconds = time.perf_counter() - start
    stored = sum(t.numel() * t.element_size() for t in (luts, encoded, sign_mantissa, positions, gaps, splits))
    return {"dfloat11_ratio": stored / (2 * flat.numel()), "dfloat11_seconds": seconds,
            "dfloat11_seconds_per_million": seconds / flat.numel() * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", nargs="*", default=[], help="weight files of trained models")
    parser.add_argument("--wheels", nargs="*", default=[],
                        help="wheels whose weight files (.jit, .pt, .safetensors, .onnx inside them) are measured")
    parser.add_argument("--random-weights", type=int, default=1 << 24, help="weights per random reference")
    parser.add_argument("--dfloat11-wheel", default=None,
                        help="the dfloat11 wheel: code every buffer with its encoder too (needs dahuffman)")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    rows = []
    scratch = tempfile.TemporaryDirectory()
    dfloat11, dfloat11_version = (load_dfloat11_encoder(Path(args.dfloat11_wheel), Path(scratch.name))
                                  if args.dfloat11_wheel else (None, None))
    files = [Path(f) for f in args.files]
    for wheel in map(Path, args.wheels):
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if member.endswith(WEIGHT_SUFFIXES):
                    files.append(Path(archive.extract(member, Path(scratch.name) / wheel.stem)))
    for path in files:
        tensors = load_tensors(path)
        if not tensors:
            continue
        flat = torch.cat([t.reshape(-1).float() for t in tensors.values()])
        row = measure(flat)
        if dfloat11 is not None:
            row.update(measure_dfloat11(dfloat11, flat))
        row.update({"source": path.name, "kind": "trained", "tensors": len(tensors),
                    "stored_dtypes": sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()})})
        rows.append(row)
        print(f"{path.name}: {row['weights']:,} weights, H {row['exponent_entropy_bits']:.2f} bits, ratio "
              f"{row['ratio']:.3f} (ideal {row['ideal_ratio']:.3f}, {row['width']}-bit)", flush=True)
    generator = torch.Generator().manual_seed(0)
    for std in (0.02, 1 / math.sqrt(3072)):
        values = torch.randn(args.random_weights, generator=generator) * std
        row = measure(values)
        if dfloat11 is not None:
            row.update(measure_dfloat11(dfloat11, values))
        row.update({"source": f"normal, std {std:.4g}", "kind": "random", "tensors": 1, "stored_dtypes": ["float32"]})
        rows.append(row)
        print(f"random std {std:.4g}: ratio {row['ratio']:.3f} (ideal {row['ideal_ratio']:.3f})", flush=True)
    scratch.cleanup()
    report = {"python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv[1:],
              "wheels": [Path(w).name for w in args.wheels], "rows": rows, "cpu": platform.processor() or
              platform.machine(), "dfloat11": dfloat11_version}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = ["# Lossless code: trained against random weights", "",
             "Each file's floating-point tensors cast to bfloat16, concatenated and coded with `offload.codec` "
             "(decoded back bit for bit). Ideal: sign and mantissa kept, the exponent at its entropy, "
             "(8 + H) / 16 of the bf16 bytes.", "",
             "| weights of | kind | weights | exponent entropy (bits) | ideal | code | width | escapes |"
             + (" DFloat11 | DFloat11 encoding (s per million weights) |" if dfloat11 else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if dfloat11 else "")]
    for r in rows:
        lines.append(f"| {r['source']} | {r['kind']} | {r['weights']:,} | {r['exponent_entropy_bits']:.2f} | "
                     f"{r['ideal_ratio']:.3f} | {r['ratio']:.3f} | {r['width']}-bit | {r['escape_share']:.2%} |"
                     + (f" {r['dfloat11_ratio']:.3f} | {r['dfloat11_seconds_per_million']:.2f} |"
                        if "dfloat11_ratio" in r else ""))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')}, .md", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
