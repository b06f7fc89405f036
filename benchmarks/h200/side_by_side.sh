#!/usr/bin/env bash
# The offload benchmark (benchmarks/offload_bench.py) of this tree and of a baseline commit's tree, side by side in
# one device call: "behaviour unchanged" checks of a refactor, and new variants against the old code's run.
#   here:        rm -rf .baseline && mkdir .baseline && git archive BASE diffusers_omni benchmarks | tar -x -C .baseline
#                rm -rf .baseline/benchmarks/results    # .baseline is git-ignored (.git/info/exclude); carry it
#   device run:  BASELINE_COMMIT=BASE OMNI_COMMIT=$(git rev-parse HEAD) bash benchmarks/h200/side_by_side.sh \
#                  "flux:layerwise:layerwise,lossless" "wan:layerwise:layerwise,lossless"
# Each argument is MODEL:BASELINE_VARIANTS:CURRENT_VARIANTS[:BUDGET] (offload_bench's --models, --variants and
# --budget; an empty BASELINE_VARIANTS runs only the current tree). Every run writes PREFIX.json/.md/.png; they come
# back in one archive, $OUT/side_by_side.tgz, with the log ($OUT allows few files).
# Filed as a result (benchmarks/results/ holds only registered scenarios' suites, never these raw files):
#   python -m benchmarks run offload-side-by-side    wraps this script (the scenario's specs in benchmarks/registry.py;
#                                                    BASELINE_COMMIT and OMNI_COMMIT set) and files the comparison
#   python -m benchmarks.side_by_side --collect side_by_side.tgz --out X    collects an archive brought back from a
#                                                    device call (X.json, X.md); --file-result files it as the
#                                                    scenario's latest.json (meta from commits.txt and the reports)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONUNBUFFERED=1
root=$(pwd)
out=$(mktemp -d)
printf 'baseline %s\ncurrent %s\n' "${BASELINE_COMMIT:-unknown}" "${OMNI_COMMIT:-unknown}" > "$out/commits.txt"
status=0
for spec in "$@"; do
  IFS=: read -r model base_variants variants budget <<<"$spec"
  budget=${budget:-12GiB}
  tag="$model-${budget}"
  if [ -n "$base_variants" ]; then
    echo "== baseline ${BASELINE_COMMIT:-?}: $model $base_variants"
    (cd "$root/.baseline" && PYTHONPATH="$root/.baseline:/tmp/site" python3 -m benchmarks.offload_bench \
      --models "$model" --variants "$base_variants" --budget "$budget" --budget-models "$model" \
      --skip-model-level --out "$out/baseline-$tag") || status=1
  fi
  echo "== current ${OMNI_COMMIT:-?}: $model $variants"
  PYTHONPATH="$root:/tmp/site" python3 -m benchmarks.offload_bench --models "$model" --variants "$variants" \
    --budget "$budget" --budget-models "$model" --skip-model-level --out "$out/current-$tag" || status=1
  tar -czf "${OUT:-/tmp}/side_by_side.tgz" -C "$out" .  # after each run: a call cut short keeps what finished
done
exit $status
