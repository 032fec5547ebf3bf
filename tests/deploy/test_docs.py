"""The docs: the generated reference pages say what the code does."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tools.reference import cli_page, metrics_page

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(("page", "generated"), [("metrics.md", metrics_page), ("cli.md", cli_page)])
def test_the_generated_reference_pages_are_current(page, generated):
    written = (ROOT / "docs" / "reference" / page).read_text()
    renew = f"python -m gateway.tools.reference {page.removesuffix('.md')} > docs/reference/{page}"
    assert written == generated(), f"docs/reference/{page} is stale: {renew}"
