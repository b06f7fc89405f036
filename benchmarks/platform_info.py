"""``diffusers-omni info`` on the benchmark machine, kept with the results: PREFIX.json (``info --json``) and
PREFIX.txt (the text a user pastes into a bug report).

    python -m benchmarks run info          # through the runner (benchmarks/h200/run_all.sh info on the H200)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def info(*options: str) -> str:
    """The output of ``diffusers-omni info OPTIONS`` run in a child interpreter (as a user runs it)."""
    done = subprocess.run([sys.executable, "-m", "diffusers_omni.cli.main", "info", *options], capture_output=True,
                          text=True, check=True, env={**os.environ, "COLUMNS": "200"})
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json and PREFIX.txt")
    args = parser.parse_args()
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(json.loads(info("--json")), indent=2) + "\n")
    prefix.with_suffix(".txt").write_text(info())


if __name__ == "__main__":
    main()
