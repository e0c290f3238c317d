"""README.md is a front page and docs/ a site that builds: the generated pages match the
code they come from, every link stays inside the repository, and `mkdocs build --strict`
passes with no asset or link from elsewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from app.settings import Settings
from scripts import docs_pages, mkdocs_hooks
from tests.stack import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# [text](target) and ![alt](target); a target ends at whitespace or the closing paren.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


@pytest.mark.parametrize("name", sorted(docs_pages.PAGES))
def test_a_generated_page_matches_its_source(name: str) -> None:
    want = docs_pages.PAGES[name]()
    got = (ROOT / "docs" / name).read_text()
    assert got == want, f"docs/{name} has drifted from its source: run `make docs`"


def test_every_setting_is_described_and_on_the_configuration_page() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    for name, field in Settings.model_fields.items():
        assert field.description, f"Settings.{name} needs a docstring (its line in the docs)"
        assert f"| `MAEC_{name.upper()}` |" in page, name
    rows = [line for line in page.splitlines() if line.startswith("| `MAEC_")]
    assert len(rows) == len(Settings.model_fields)


def test_the_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 80
    assert "make run" in text and "make test" in text
    assert text.count("```bash") == 2  # the two commands, the first job
    first = text[text.index("## First job"):].split("```bash\n", 1)[1].split("```")[0]
    assert len(first.splitlines()) <= 6
    linked = {t.split("#")[0] for t in LINK.findall(text)}
    for page in ("quickstart", "recipes", "maec", "evaluation", "api", "api-reference",
                 "client", "configuration", "deploy", "reliability", "benchmarks",
                 "experiments", "layout"):
        assert f"docs/{page}.md" in linked, page


def test_the_docs_home_includes_the_readme_with_its_links_working() -> None:
    # docs/index.md holds the README's place, not a copy of it; included, every README
    # link must still land on a page of the site.
    index = (ROOT / "docs" / "index.md").read_text()
    assert index.count(mkdocs_hooks.INCLUDE) == 1
    readme = (ROOT / "README.md").read_text()
    assert readme.splitlines()[2] not in index  # no copied paragraph
    home = mkdocs_hooks.on_page_markdown(index, SimpleNamespace(
        file=SimpleNamespace(src_uri="index.md")))
    assert home.startswith(readme.splitlines()[0]) and "## How a job goes" in home
    for target in LINK.findall(home):
        path = target.split("#")[0]
        assert path and (ROOT / "docs" / path).is_file(), target
    yml = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert yml["hooks"] == ["scripts/mkdocs_hooks.py"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_stays_inside_the_repository(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"<https?://", text), "an autolink out of the repository"
    for target in LINK.findall(text):
        assert "://" not in target and not target.startswith(("mailto:", "//")), target
        path = target.split("#")[0]
        if not path:
            continue
        resolved = (page.parent / path).resolve()
        assert resolved.is_relative_to(ROOT), f"{target} leaves the repository"
        assert resolved.exists(), f"{target} does not exist"


def test_every_page_is_in_the_nav() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def files(items: object) -> list[str]:
        if isinstance(items, str):
            return [items]
        if isinstance(items, list):
            return [f for item in items for f in files(item)]
        if isinstance(items, dict):
            return [f for value in items.values() for f in files(value)]
        return []

    listed = set(files(nav))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == listed


def test_the_site_builds_strictly_and_self_contained(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--quiet",
         "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    html = [p for p in (tmp_path / "site").rglob("*.html")]
    assert len(html) >= 12
    for page in html:
        assert "```" not in page.read_text(), f"{page}: a code fence left open or unparsed"
        refs = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.read_text())
        outside = [r for r in refs if re.match(r"(https?:)?//", r)]
        assert not outside, (page, outside)
