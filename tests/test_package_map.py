"""docs/architecture.md's package map names every module of oases and of the model zoo,
each in its package's paragraph, and nothing that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"


def _paragraphs() -> dict[str, str]:
    """package folder (``oases/config/``, ``models/``) -> its paragraph of the map."""
    text = DOC.read_text().split("## The package map", 1)[1].split("\n## ", 1)[0]
    out = {}
    for para in text.split("\n\n"):
        m = re.match(r"\*\*`([\w/]+/)`\.\*\*", para.strip())
        if m:
            out[m.group(1)] = para
    return out


def _forwarding(path: Path) -> bool:
    """``oases/plan.py`` and the like: one line forwarding ``python -m oases.<command>``."""
    return "from oases.cli." in path.read_text() and path.parent.name == "oases"


def _modules() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for root in (REPO / "oases", REPO / "models"):
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(REPO)
            if p.name in ("__init__.py", "__main__.py") or len(rel.parts) < 3 and \
                    root.name == "oases":
                continue
            folder = f"{rel.parent.as_posix()}/"
            name = p.name
            if folder.startswith("oases/config/archs"):  # one file per architecture
                folder, name = "oases/config/", "archs/"
            if name not in out.get(folder, []):
                out.setdefault(folder, []).append(name)
    return out


def test_every_module_is_on_the_map():
    paras = _paragraphs()
    missing = [f"{folder}{name}" for folder, names in _modules().items() for name in names
               if folder not in paras or f"`{name}`" not in paras[folder]]
    assert not missing, f"docs/architecture.md's package map lacks: {', '.join(missing)}"


def test_the_map_names_no_module_that_is_gone():
    paras, modules = _paragraphs(), _modules()
    assert set(paras) - {"oases/"} <= set(modules), set(paras) - set(modules)
    stale = [f"{folder}{name}" for folder, para in paras.items() if folder in modules
             for name in re.findall(r"`(\w+\.py)`", para)
             if name not in modules[folder] and name != "__main__.py"]
    assert not stale, f"the map names modules that do not exist: {', '.join(stale)}"


def test_top_level_modules_are_named():
    text = DOC.read_text()
    for p in sorted((REPO / "oases").glob("*.py")):
        if p.name == "__init__.py" or _forwarding(p):
            continue
        assert f"`oases/{p.name}`" in text, p.name
