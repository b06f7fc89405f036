"""``diffusers-omni models``: the supported-models table, generated from the declarations."""

from __future__ import annotations

import json


def run(args) -> int:
    from ..models.table import supported_models, supported_models_markdown

    print(json.dumps(supported_models(), indent=2) if args.json else supported_models_markdown())
    return 0
