"""Every notebook takes its device from one variable at the top (the GPU when there is one), never a literal."""

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
DEVICE = 'device = "cuda" if torch.cuda.is_available() else "cpu"'


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_device_comes_from_the_variable_in_the_first_code_cell(path):
    code = [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
    assert DEVICE in code[0]
    for source in code:
        # The one definition aside, no cell names a device itself: device="cpu", .to("cuda"), torch.device("cpu").
        literal = re.findall(r"""["'](?:cpu|cuda(?::\d+)?|mps)["']""", source.replace(DEVICE, ""))
        assert not literal, (path.name, source)
