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
for spec in diffusers==0.42.1 fa3-fwd==0.0.3 flashinfer-python==0.6.4 "apache-tvm-ffi<0.2" sageattention==1.0.6; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$spec"
done
du -sh .whl
