"""Code examples of the docs, run as written: each is a fenced block marked with an HTML
comment (``<!-- example:NAME -->``) in its page."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "custom-blocks.md"


def custom_block_example() -> dict:
    """The names docs/custom-blocks.md's custom-block example defines."""
    text = DOC.read_text()
    m = re.search(r"<!-- example:custom-block -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/custom-blocks.md lost its custom-block example"
    ns: dict = {}
    exec(compile(m.group(1), "docs/custom-blocks.md:custom-block", "exec"), ns)
    return ns
