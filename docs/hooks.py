"""MkDocs hook (mkdocs.yml `hooks:`): links from a page to a file of the repository outside docs/.

A page links to a recipe's README or a script as a relative path out of docs/ (`../../recipes/reviews/README.md`),
which works where the repository is read and in the built site, since site/ sits beside docs/ at the repository
root. MkDocs would report such a link as not found among the documentation files; this hook checks instead that
the file exists in the repository (a warning, which `mkdocs build --strict` turns into a failure, when it does
not) and hands the link on as HTML, which MkDocs leaves as it is.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repository_links")

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^()\s]+)\)")  # [text](target), not an image
FENCE = re.compile(r"^(```|~~~)")


def outside_docs(page_path: str, target: str) -> str | None:
    """The repository path a link from docs/`page_path` points to, when it leaves docs/; else None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#")[0]
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_path), path))
    return None if joined == "docs" or joined.startswith("docs/") else joined


def on_page_markdown(markdown: str, page, config, files) -> str:
    out, in_fence = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
        if not in_fence:
            line = LINK.sub(lambda m: _rewrite(m, page.file.src_uri), line)
        out.append(line)
    return "\n".join(out)


def _rewrite(match: re.Match, page_path: str) -> str:
    text, target = match.group(1), match.group(2)
    repo_path = outside_docs(page_path, target)
    if repo_path is None:
        return match.group(0)
    if repo_path.startswith("../") or not (ROOT / repo_path).exists():
        log.warning(
            f"Doc file '{page_path}' links to '{target}', but '{repo_path}' is not in the repository."
        )
    return f'<a href="{target}">{text}</a>'
