"""Real English text we did not write: sentences from the standard library's docstrings."""

from __future__ import annotations

import importlib
import inspect
import re

# Modules whose docstrings are prose (in this order, so the corpus is the same on every run).
MODULES = ("os", "os.path", "json", "collections", "itertools", "functools", "re", "string", "textwrap",
           "pathlib", "subprocess", "threading", "asyncio", "socket", "http.client", "urllib.request",
           "email.message", "logging", "argparse", "csv", "decimal", "fractions", "statistics", "random",
           "datetime", "calendar", "heapq", "bisect", "shutil", "tempfile", "zipfile", "tarfile", "pickle",
           "copy", "inspect", "typing", "dataclasses", "contextlib", "unittest", "doctest", "difflib",
           "sqlite3", "xml.dom.minidom", "html.parser", "configparser", "hashlib", "base64", "uuid")
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def _docstrings() -> list[str]:
    docs: list[str] = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        docs.append(inspect.getdoc(mod) or "")
        for attr in sorted(vars(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
                docs.append(inspect.getdoc(obj) or "")
    return docs


def stdlib_sentences(n: int | None = None, *, min_words: int = 3, max_words: int = 100) -> list[str]:
    """Distinct sentences from stdlib docstrings (``min_words``..``max_words`` words), repeated to ``n``."""
    seen: dict[str, None] = {}
    for doc in _docstrings():
        for para in re.split(r"\n\s*\n", doc):
            text = " ".join(para.split())
            for s in _SPLIT.split(text):
                if min_words <= len(s.split()) <= max_words and any(c.isalpha() for c in s):
                    seen.setdefault(s, None)
    unique = list(seen)
    if n is None:
        return unique
    return [unique[i % len(unique)] for i in range(n)]


def read_corpus(path: str, max_words: int | None = None) -> list[str]:
    """One sentence per non-empty line of a UTF-8 file (longer ones cut to ``max_words`` words)."""
    with open(path, encoding="utf-8") as f:
        lines = [" ".join(line.split()) for line in f]
    lines = [s for s in lines if s]
    if max_words is not None:
        lines = [" ".join(s.split()[:max_words]) for s in lines]
    return lines


if __name__ == "__main__":  # python -m bench._corpus [N] > sentences.txt
    import sys

    for line in stdlib_sentences(int(sys.argv[1]) if len(sys.argv) > 1 else None, max_words=40):
        print(line)
