#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the H200 runs need into .whl/ (git-ignored), for `device`
# calls that carry .whl. The GPU image has torch 2.11+cu130, Triton, numpy, einops, ninja, requests, tqdm, click and
# nvidia-ml-py; FlashInfer runs its fa3 prefill without its other dependencies (shared baseline). Versions are the
# ones the shared baseline ran.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
# torchao 0.17.0: the 0.18 wheel targets a newer torch than the image's 2.11. gguf for GGUF checkpoints.
for spec in diffusers==0.42.1 fa3-fwd==0.0.3 flashinfer-python==0.6.4 "apache-tvm-ffi<0.2" sageattention==1.0.6 \
            torchao==0.17.0 gguf==0.19.0 bitsandbytes==0.50.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$spec"
done
# The quantized offload check's LoRA scenarios: peft and what it imports, kept apart (.whl/lora) so that only that
# job runs with them.
for spec in peft==0.21.2 accelerate==1.16.0 psutil==7.2.2 pyyaml==6.0.4; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl/lora "$spec"
done
# The whole-pipeline offload benchmark (pipeline-offload-*), kept apart (.whl/pipeline) so that only those jobs run
# with them: mmgp (the newest 3.8) and optimum-quanto, which mmgp imports at module level; accelerate (mmgp imports
# it, and Diffusers' enable_model_cpu_offload / enable_sequential_cpu_offload need it) with what it imports (psutil,
# which mmgp imports too, and pyyaml), at .whl/lora's versions. Pure Python but psutil and pyyaml; 1.6 MB in all.
for spec in mmgp==3.8.2 optimum-quanto==0.2.7 accelerate==1.16.0 psutil==7.2.2 pyyaml==6.0.4; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl/pipeline "$spec"
done
# bitsandbytes ships one library per CUDA version (~200 MB): keep the image's cuda130 one and the CPU one, and
# regenerate RECORD so pip installs the slimmed wheel.
python3 - <<'PY'
import base64, csv, glob, hashlib, io, os, zipfile
for path in glob.glob(".whl/bitsandbytes-*.whl"):
    keep = lambda name: not (name.startswith("bitsandbytes/libbitsandbytes_") and not name.endswith(
        ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")))
    with zipfile.ZipFile(path) as source:
        files = {n: source.read(n) for n in source.namelist() if keep(n) and not n.endswith(".dist-info/RECORD")}
        record = next(n for n in source.namelist() if n.endswith(".dist-info/RECORD"))
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([name, f"sha256={digest}", len(data)])
    writer.writerow([record, "", ""])
    files[record] = rows.getvalue().encode()
    slim = path + ".slim"
    with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for name, data in files.items():
            target.writestr(name, data)
    os.replace(slim, path)
    print(f"slimmed {path}: {os.path.getsize(path) / 2**20:.1f} MiB")
PY
du -sh .whl
