"""``diffusers-omni models``: the supported-models table, generated from the declarations so the docs never drift
from the code.

    python -m diffusers_omni.cli.models --write docs/user_guide/supported_models.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..models.base import declarations
from ..pipelines.registry import omni_pipelines
from ..utils.text import Width, fit, output_width, table

BEGIN = "<!-- BEGIN GENERATED: supported-models (python -m diffusers_omni.cli.models --write) -->"
END = "<!-- END GENERATED: supported-models -->"

# The systems of vLLM-Omni's table that Diffusers 0.42 has no pipeline for: this package's own pipelines serve them.
OWN_SYSTEMS = "NextStep-1.1, BAGEL and SoulX-Singer"


def supported_models() -> list[dict]:
    """One row per transformer declaration, with the Omni pipelines that drive it."""
    pipelines_by_family: dict[str, list[str]] = {}
    model_level: dict[str, bool] = {}  # a family refuses model-level offload with ``_model_level_offload = False``
    for omni_cls in omni_pipelines().values():
        pipelines_by_family.setdefault(omni_cls._omni_family, []).append(omni_cls.__name__)
        model_level[omni_cls._omni_family] = model_level.get(omni_cls._omni_family, True) and getattr(
            omni_cls, "_model_level_offload", True)
    rows = []
    # Sorted: registration order depends on which model modules were imported first.
    for declaration in sorted(declarations(), key=lambda d: (d.display_name or d.name).lower()):
        streamable = bool(declaration.blocks_attrs)
        rows.append(
            {
                "architecture": declaration.display_name or declaration.name,
                "example_checkpoint": declaration.example_checkpoint,
                "dit_classes": list(declaration.class_names),
                "pipelines": sorted(pipelines_by_family.get(declaration.name, [])),
                "roles": [
                    f"{role.role} ({role.category}{', masked' if role.masked else ''}{', GQA' if role.gqa else ''})"
                    for role in declaration.roles
                ],
                "model_level_offload": declaration.model_level_offload and model_level.get(declaration.name, True),
                "layerwise_offload": streamable,
                "distributed_layerwise_offload": streamable,
                "blocks_attrs": list(declaration.blocks_attrs),
            }
        )
    return rows


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def supported_models_markdown() -> str:
    lines = [
        "| Architecture | Example checkpoint | DiT class | Omni pipelines | Roles (category) | Model-level | Layerwise | "
        "Distributed | Block attributes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in supported_models():
        lines.append(
            f"| {row['architecture']} | `{row['example_checkpoint']}` | {', '.join(f'`{c}`' for c in row['dit_classes'])} | "
            f"{', '.join(f'`{p}`' for p in row['pipelines'])} | {'<br>'.join(f'`{r}`' for r in row['roles'])} | "
            f"{_yes(row['model_level_offload'])} | {_yes(row['layerwise_offload'])} | "
            f"{_yes(row['distributed_layerwise_offload'])} | {', '.join(f'`{b}`' for b in row['blocks_attrs'])} |"
        )
    lines += ["", f"{OWN_SYSTEMS} have no Diffusers 0.42 pipeline: their pipelines are this package's own "
                  "(`diffusers_omni.architectures`), loaded from the published checkpoints' layout."]
    return "\n".join(lines)


# The columns ``models`` prints on a terminal, most useful first: a narrow terminal shows the first ones that fit.
TERMINAL_COLUMNS = ("architecture", "roles (category)", "Omni pipelines", "example checkpoint", "DiT class",
                    "offload", "block attributes")


def _terminal_rows() -> list[dict]:
    rows = []
    for row in supported_models():
        offload = [name for name, key in (("model-level", "model_level_offload"), ("layerwise", "layerwise_offload"),
                                          ("distributed", "distributed_layerwise_offload")) if row[key]]
        rows.append({
            "architecture": row["architecture"],
            "roles (category)": "\n".join(row["roles"]),
            "Omni pipelines": "\n".join(row["pipelines"]),
            "example checkpoint": row["example_checkpoint"],
            "DiT class": "\n".join(row["dit_classes"]),
            "offload": "\n".join(offload) or "no",
            "block attributes": "\n".join(row["blocks_attrs"]),
        })
    return rows


def supported_models_table(width: Width = "terminal") -> str:
    """The table ``diffusers-omni models`` prints on a terminal, one row per architecture.

    ``width`` (default: the terminal's; ``None``, also when not on a terminal: every column) decides how many of
    ``TERMINAL_COLUMNS`` are shown: the first ones whose cells fit whole, at least the first two; the note under the
    table names the columns left out and where to see them.
    """
    width = output_width() if width == "terminal" else width
    rows = _terminal_rows()
    shown = len(TERMINAL_COLUMNS)
    while width is not None and shown > 2:
        text = table(rows, TERMINAL_COLUMNS[:shown], width=None, row_gap=True)
        if max(len(line) for line in text.splitlines()) <= width:
            break
        shown -= 1
    if "Omni pipelines" not in TERMINAL_COLUMNS[:shown]:
        for row in rows:
            count = len(row["Omni pipelines"].splitlines())
            row["architecture"] += f"\n({count} Omni pipeline{'s' if count != 1 else ''})"
    text = table(rows, TERMINAL_COLUMNS[:shown], width=width, row_gap=True)
    notes = ["", f"{OWN_SYSTEMS} have no Diffusers 0.42 pipeline: their pipelines are this package's own."]
    hidden = TERMINAL_COLUMNS[shown:]
    if hidden:
        notes += ["", f"Not shown at this width: {', '.join(hidden)}; a wider terminal shows them, and so do "
                      "--markdown (the table in docs/user_guide/supported_models.md) and --json."]
    return text + "\n" + fit("\n".join(notes), width)


def embed(document: str) -> str:
    """``document`` with the text between the generated-table markers replaced by the current table."""
    start, end = document.find(BEGIN), document.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the document has no '{BEGIN}' … '{END}' section")
    return document[: start + len(BEGIN)] + "\n" + supported_models_markdown() + "\n" + document[end:]


def run(args) -> int:
    if args.json:
        print(json.dumps(supported_models(), indent=2))
    elif args.markdown:
        print(supported_models_markdown())
    else:
        print(supported_models_table())
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description="print or embed the supported-models table")
    parser.add_argument("--write", type=Path, help="markdown file whose generated section is rewritten")
    args = parser.parse_args()
    if args.write:
        args.write.write_text(embed(args.write.read_text()))
    else:
        print(supported_models_markdown())


if __name__ == "__main__":
    main()
