"""MkDocs hook: lay out the package as it is installed, for the API reference.

``kernels/`` and ``pipelines/`` ship as ``hetero.kernels`` and ``hetero.pipelines``
(``[tool.setuptools.package-dir]`` in pyproject.toml). mkdocstrings reads the source
without importing it, so it is pointed at ``build/docs-src``, where ``hetero/`` holds
links to every file of ``hetero/`` plus ``kernels`` and ``pipelines``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "docs-src"


@event_priority(100)  # before mkdocstrings reads its search paths
def on_config(config: Any) -> Any:
    pkg = TREE / "hetero"
    if TREE.exists():
        shutil.rmtree(TREE)
    pkg.mkdir(parents=True)
    for entry in sorted((ROOT / "hetero").iterdir()):
        if entry.name != "__pycache__":
            os.symlink(entry, pkg / entry.name, target_is_directory=entry.is_dir())
    for sub in ("kernels", "pipelines"):
        os.symlink(ROOT / sub, pkg / sub, target_is_directory=True)
    _list_new_guides(config)
    return config


def _list_new_guides(config: Any) -> None:
    """Guides in docs/ that the nav does not name yet go at the end of its "Guides" section."""
    named: set[str] = set()

    def walk(items: Any) -> None:
        for item in items or ():
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                walk(value)
            elif isinstance(value, str):
                named.add(value)

    nav = config.get("nav")
    walk(nav)
    guides = next((next(iter(i.values())) for i in nav or () if isinstance(i, dict) and "Guides" in i), None)
    if guides is None:
        return
    for page in sorted(Path(config["docs_dir"]).glob("*.md")):
        if page.name not in named:
            guides.append(page.name)


# Docstrings use Sphinx roles (:class:`~hetero.Tensor`); Markdown leaves the role's name in
# front of the code span. Drop it, and the module path where a leading "~" asks for that.
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _role(m: re.Match[str]) -> str:
    tilde, target = m.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(_role, html)
