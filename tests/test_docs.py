"""The documentation a clone carries: every relative link in the README and docs/ points at a
file of the checkout, and nothing sends a user to files beside it (../shared is the developers'
fixtures, which a user's clone does not have)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "models").glob("**/README.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_checkout(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    for target in targets:
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the checkout: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"


def test_the_architecture_is_in_the_checkout() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/DESIGN.md)" in readme
    assert "shared/DESIGN.md" not in readme
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    for section in ("## The floors", "## The gradient's path", "## The schemes",
                    "## The plan and the cost model", "## The wire", "## Launch",
                    "## Performance tools"):
        assert section in design
