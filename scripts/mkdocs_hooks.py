"""MkDocs hooks (mkdocs.yml ``hooks``): docs/index.md includes the README, so the front
page and the site's home are one text.

The README links to docs pages from the repository root (``docs/api.md``); the site
serves the same pages from its own root, so each such link loses its ``docs/`` on the
way in. Links to anything outside docs/ would not exist in the site: the README has none
(tests/test_docs_site.py checks both places).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The line of docs/index.md that the README replaces (a comment: invisible elsewhere).
INCLUDE = "<!-- include README.md -->"
DOCS_LINK = re.compile(r"(\]\()docs/")


def front_page() -> str:
    """The README as the site's home page shows it: links into docs/ made site-relative."""
    return DOCS_LINK.sub(r"\1", (ROOT / "README.md").read_text())


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    return markdown.replace(INCLUDE, front_page().rstrip("\n"))
