from pathlib import Path

from diffusers_omni.cli.models import embed, supported_models

PAGE = Path(__file__).resolve().parents[2] / "docs" / "user_guide" / "supported_models.md"


def test_docs_page_embeds_the_current_generated_table():
    text = PAGE.read_text()
    assert embed(text) == text, "regenerate: python -m diffusers_omni.cli.models --write " + str(PAGE)


def test_every_declaration_has_pipelines_roles_and_blocks():
    for row in supported_models():
        assert row["pipelines"], row["architecture"]
        assert row["roles"] and row["blocks_attrs"] and row["example_checkpoint"], row["architecture"]
