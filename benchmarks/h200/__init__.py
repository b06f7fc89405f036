"""Scripts for the H200 runs (``bash benchmarks/h200/run_all.sh <job>``)."""
