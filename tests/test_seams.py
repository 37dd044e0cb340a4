"""The seams between modules: test files share tests/support, never each other, and no
module reaches into another's underscore names (make the name public instead).

Both checks read the source with ``ast``; each is shown to catch an injected offender.
An underscore name counts in ``from m import _x`` (a package's own ``__init__`` is another
module too) and in ``m._x`` where ``m`` is one of our modules bound by an import.
Dunder names (``__version__``) are public.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("oases", "models", "tests", "benchmarks")
SCANNED = ("oases", "models", "tests", "benchmarks")


def python_files(root: Path, folders=SCANNED) -> list[Path]:
    """Every .py under ``folders``, links not followed (oases/models is models/)."""
    out = []
    for folder in folders:
        for d, dirs, files in os.walk(root / folder):
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "results"))
            out += [Path(d) / f for f in sorted(files) if f.endswith(".py")]
    return out


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_our_module(dotted: str, root: Path) -> bool:
    """``dotted`` names a module or package file of ours (oases.models.* through the link)."""
    if dotted.split(".")[0] not in OURS:
        return False
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def absolute(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved against ``here``."""
    if not node.level:
        return node.module or ""
    parts = here.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = parts[:max(keep, 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_test_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) for each ``tests.test_*`` module that ``path`` imports."""
    here = module_name(path, root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = absolute(node, here, path.name == "__init__.py")
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names
                  if n.startswith("tests.test_") and n.count(".") == 1]
    return found


def private_uses(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, dotted name) for each underscore name ``path`` takes from another module of
    ours (torch's private names are torch's business)."""
    here = module_name(path, root)
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> the module of ours it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            mod = absolute(node, here, path.name == "__init__.py")
            if mod == "__future__":
                continue
            for a in node.names:
                if is_private(a.name) and mod != here and mod.split(".")[0] in OURS:
                    found.append((node.lineno, f"{mod}.{a.name}"))
                if is_our_module(f"{mod}.{a.name}", root):
                    bound[a.asname or a.name] = f"{mod}.{a.name}"

    def dotted(node) -> str | None:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            base = dotted(node.value)
            if base is not None and base != here and is_our_module(base, root):
                found.append((node.lineno, f"{base}.{node.attr}"))
    return sorted(set(found))


def offenders(check, files: list[Path], root: Path = ROOT) -> list[str]:
    return [f"{p.relative_to(root)}:{line} {name}" for p in files for line, name in check(p, root)]


def test_no_test_file_imports_another():
    files = sorted((ROOT / "tests").glob("test_*.py"))
    assert len(files) > 50
    bad = offenders(imported_test_modules, files)
    assert not bad, "test files importing other test files (share via tests/support):\n" + \
        "\n".join(bad)


def test_no_module_takes_another_modules_underscore_names():
    bad = offenders(private_uses, python_files(ROOT))
    assert not bad, f"{len(bad)} underscore names taken across modules:\n" + "\n".join(bad)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_the_test_file_check_catches_an_injected_import(tmp_path):
    root = _tree(tmp_path, {
        "tests/__init__.py": "",
        "tests/support/__init__.py": "",
        "tests/support/runs.py": "REPO = 1\n",
        "tests/test_a.py": "X = 1\n",
        "tests/test_b.py": "from tests.support.runs import REPO\nimport os\n",
        "tests/test_c.py": "import os\n\ndef f():\n    from tests.test_a import X\n",
        "tests/test_d.py": "from tests import test_a\nimport tests.test_b as b\n",
    })
    files = sorted((root / "tests").glob("test_*.py"))
    assert offenders(imported_test_modules, files, root) == [
        "tests/test_c.py:4 tests.test_a", "tests/test_d.py:1 tests.test_a",
        "tests/test_d.py:2 tests.test_b"]


def test_the_underscore_check_catches_injected_uses(tmp_path):
    root = _tree(tmp_path, {
        "oases/__init__.py": "",
        "oases/pkg/__init__.py": "from oases.pkg.inner import _hidden\n",
        "oases/pkg/inner.py": "_hidden = 1\n__version__ = 2\n\ndef _own():\n    return _hidden\n",
        "oases/user.py": ("import oases.pkg.inner\nfrom oases.pkg import inner as mod\n"
                          "from oases.pkg.inner import __version__\n\n"
                          "def f(obj):\n    return (mod._own(), oases.pkg.inner._hidden, obj._x,\n"
                          "            mod.__name__)\n"),
        "oases/pkg/rel.py": "from .inner import _own\nfrom . import _hidden\n",
        "tests/__init__.py": "",
        "tests/test_x.py": ("import torch\nfrom torch.nn import _reduction\n\n"
                            "def test():\n    torch._C\n"),
    })
    assert sorted(offenders(private_uses, python_files(root, ("oases", "tests")), root)) == [
        "oases/pkg/__init__.py:1 oases.pkg.inner._hidden",
        "oases/pkg/rel.py:1 oases.pkg.inner._own",
        "oases/pkg/rel.py:2 oases.pkg._hidden",
        "oases/user.py:6 oases.pkg.inner._hidden",
        "oases/user.py:6 oases.pkg.inner._own",
    ]
