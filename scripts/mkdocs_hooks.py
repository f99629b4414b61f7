"""mkdocs hook (mkdocs.yml ``hooks:``): show the docstrings' doctest examples as code in the API reference.

densepass's docstrings carry ``>>>`` examples in their prose (pytest runs them with ``--doctest-modules``).
Markdown has no doctest blocks: it would run the lines together into a paragraph, and read ``[a][b]``-shaped
output as a reference link. This adds a Markdown preprocessor, before mkdocstrings reads the site's Markdown
extensions, that puts every run of ``>>>`` / ``...`` lines and the output under them (up to a blank line) in a
fenced ``pycon`` block; lines already inside a fenced block are left alone.
"""

from __future__ import annotations

import re

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

FENCE = re.compile(r"^\s*(```|~~~)")
PROMPT = re.compile(r"^(\s*)>>>( |$)")


class DoctestBlocks(Preprocessor):
    """Wrap doctest runs (a ``>>>`` line, its ``...`` continuations and output lines) in fenced code."""

    def run(self, lines: list[str]) -> list[str]:
        """The page's lines with each doctest run fenced."""
        out: list[str] = []
        in_fence = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if FENCE.match(line):
                in_fence = not in_fence
            prompt = None if in_fence else PROMPT.match(line)
            if prompt is None:
                out.append(line)
                i += 1
                continue
            indent = prompt.group(1)
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
                i += 1
            if out and out[-1].strip():
                out.append("")
            out.extend([f"{indent}```pycon", *(indent + b for b in block), f"{indent}```", ""])
        return out


class DoctestExtension(Extension):
    """The Markdown extension that registers :class:`DoctestBlocks` before fenced code is parsed."""

    def extendMarkdown(self, md):  # noqa: N802 (Markdown's API)
        """Register the preprocessor (priority 40: before fenced code blocks are read)."""
        md.preprocessors.register(DoctestBlocks(md), "densepass_doctest", 40)


@event_priority(100)  # before mkdocstrings copies the extension list for its docstring renderer
def on_config(config):
    """Add the extension to the site's Markdown extensions, which mkdocstrings renders docstrings with."""
    config.markdown_extensions.append(DoctestExtension())
    return config
