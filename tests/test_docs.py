"""The documentation's references are real: README.md and docs/*.md.

Every page is read as markdown and checked, without importing oases or torch:

* repository paths (``oases/runtime/trainer.py``, ``configs/gpt.yaml``, a folder such as
  ``oases/parallel/``) exist;
* ``python -m X`` names a module that ``-m`` can run (repository modules are resolved
  on disk, others with ``importlib.util.find_spec`` of their top-level package);
* dotted names under ``oases.``, ``models.`` and ``benchmarks.``
  (``oases.parallel.block.TPBlock``) name a module, and a name that module (or class)
  defines;
* ``oases <command>`` is a command of the console script (its table in
  ``oases/cli/__main__.py``);
* ``make <target>`` is a target of the Makefile;
* ``section.key`` config keys (``parallel.tp``, ``train.steps``) are fields of the
  Config dataclasses (read from ``oases/config/schema.py``);
* relative markdown links point at files that exist, and ``#anchors`` at headings.

Paths, modules, commands and keys are looked for in code (inline spans and fenced
blocks); paths and links anywhere. :func:`check_markdown` returns the problems of one
page; the synthetic cases at the end show that each kind of bad reference is caught.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

# Top-level entries a repository path starts with (generated folders such as data/ and
# runs/ are not checked: they exist only after a run).
_PATH_DIRS = ("oases", "models", "configs", "benchmarks", "tests", "examples", "docs")
_PATH_FILES = ("train.py", "Makefile", "pyproject.toml", "README.md")
_PATH_RE = re.compile(
    r"(?<![\w./\-:~$])((?:%s)/[\w./*<>{}\-]*|(?:%s)(?![\w.\-]))"
    % ("|".join(_PATH_DIRS), "|".join(re.escape(f) for f in _PATH_FILES)))
_PLACEHOLDER = re.compile(r"[*<>{}]|\.\.\.")

_MODULE_RE = re.compile(r"(?<![\w-])python3?\s+-m\s+([A-Za-z_][\w.]*)")
_DOTTED_RE = re.compile(r"(?<![\w./\-])((?:oases|models|benchmarks)(?:\.[A-Za-z_]\w*)+)")
_MAKE_RE = re.compile(r"(?:^|[\s;&|(`])make((?:[ \t]+[^\s;&|)`#]+)*)", re.M)
_SUB_RE = re.compile(r"(?:^|[;&|(]\s*|\$\s+)oases[ \t]+([a-z][\w-]*)", re.M)
SECTIONS = ("model", "parallel", "train", "data", "eval", "checkpoint", "wandb")
_KEY_RE = re.compile(r"(?<![\w./\-])(%s)\.([A-Za-z_]\w*)(?![\w(])(?!\.[A-Za-z_])"
                     % "|".join(SECTIONS))
_FILE_EXTS = {"py", "bin", "json", "jsonl", "yaml", "yml", "pt", "safetensors", "md", "png",
              "txt", "log", "sh", "sbatch", "index"}
_LINK_RE = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE_RE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
_SPAN_RE = re.compile(r"(`+)(.+?)\1", re.S)


# --------------------------------------------------------------------------- markdown

def split_markdown(text: str) -> tuple[list[str], str]:
    """(code pieces: fenced blocks and inline spans, the prose with the code removed)."""
    code = [m.group(2) for m in _FENCE_RE.finditer(text)]
    rest = _FENCE_RE.sub("\n", text)
    code += [m.group(2) for m in _SPAN_RE.finditer(rest)]
    prose = _SPAN_RE.sub(" ", rest)
    return code, prose


def slug(heading: str) -> str:
    """The anchor a heading gets (GitHub's rule): lower case, punctuation dropped,
    spaces to hyphens."""
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    s = re.sub(r"[^\w\- ]", "", s.replace("`", ""))
    return s.replace(" ", "-")


def anchors(text: str) -> set[str]:
    out: set[str] = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*#*$", _FENCE_RE.sub("\n", text), re.M):
        base, n = slug(m.group(1)), 0
        name = base
        while name in out:
            n += 1
            name = f"{base}-{n}"
        out.add(name)
    return out


# --------------------------------------------------------------------------- what exists

def _module_file(name: str) -> Path | None:
    """The file of a repository module or package (``oases.runtime.trainer``), or None."""
    parts = name.split(".")
    base = ROOT.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


def runnable_module(name: str) -> bool:
    """``python -m name`` would find something to run (not run here)."""
    top = name.split(".")[0]
    if (ROOT / top).is_dir() and (ROOT / top / "__init__.py").is_file():
        f = _module_file(name)
        if f is None:
            return False
        return f.name != "__init__.py" or (f.parent / "__main__.py").is_file()
    if "." in name:  # an installed package's submodule: locating it would import the parent
        return importlib.util.find_spec(top) is not None
    return importlib.util.find_spec(name) is not None


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _module_names(f: Path) -> tuple[set[str], bool]:
    """Names a module file defines, following ``from oases.x import *`` (and whether a
    star import could not be followed)."""
    names, star = _defined(_tree(f).body)
    unresolved = False
    if star:
        for node in _tree(f).body:
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                src = _module_file(node.module or "")
                if src is None:
                    unresolved = True
                    continue
                sub, u = _module_names(src)
                names |= {n for n in sub if not n.startswith("_")}
                unresolved |= u
    return names, unresolved


def _defined(body: list[ast.stmt]) -> tuple[set[str], bool]:
    """Names a module or class body defines (and whether it star-imports)."""
    names, star = set(), False
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*":
                    star = True
                else:
                    names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, (ast.If, ast.Try)):
            sub, s = _defined(node.body + node.orelse
                              + [x for h in getattr(node, "handlers", []) for x in h.body])
            names |= sub
            star |= s
    return names, star


def dotted_problem(name: str) -> str | None:
    """None if ``name`` is a repository module, or a module followed by a name it defines
    (and, for a class, an attribute the class defines)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        f = _module_file(".".join(parts[:i]))
        if f is not None:
            break
    else:
        return f"module {name} does not exist"
    rest = parts[i:]
    if not rest:
        return None
    if (f.parent / rest[0]).with_suffix(".py").is_file() and f.name == "__init__.py":
        return None
    body = _tree(f).body
    names, star = _module_names(f)
    if rest[0] not in names:
        return None if star else f"{'.'.join(parts[:i])} defines no {rest[0]} ({name})"
    if len(rest) > 1:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == rest[0]), None)
        if cls is not None:
            attrs, _ = _defined(cls.body)
            if rest[1] not in attrs:
                return f"{'.'.join(parts[:i + 1])} has no attribute {rest[1]} ({name})"
    return None


@lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    out = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-/ ]+?)\s*::?(?!=)", line)
        if m and not line.startswith("\t"):
            out |= set(m.group(1).split())
    return frozenset(out)


@lru_cache(maxsize=None)
def config_fields() -> dict[str, frozenset[str]]:
    """Section -> its field names, from the dataclasses in oases/config/schema.py (and
    the sections it imports from oases/config/model.py and observe.py)."""
    classes = {n.name: n for page in ("schema.py", "model.py", "observe.py")
               for n in _tree(ROOT / "oases" / "config" / page).body
               if isinstance(n, ast.ClassDef)}

    def fields(cls: ast.ClassDef) -> dict[str, str]:
        out = {}
        for n in cls.body:
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                out[n.target.id] = ast.unparse(n.annotation)
        return out

    top = fields(classes["Config"])
    return {sec: frozenset(fields(classes[top[sec]])) for sec in SECTIONS}


def cli_commands() -> frozenset[str] | None:
    """The console script's commands, read from the table in oases/cli/__main__.py (a dict,
    list, tuple or set of command names that includes "plan"); None without that file."""
    f = ROOT / "oases" / "cli" / "__main__.py"
    if not f.is_file():
        return None
    for node in ast.walk(_tree(f)):
        if isinstance(node, ast.Dict):
            items = node.keys
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = node.elts
        else:
            continue
        strs = [k.value for k in items if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        if "plan" in strs and len(strs) == len(items):
            return frozenset(strs)
    return frozenset()


# --------------------------------------------------------------------------- the checker

def check_markdown(text: str, source: Path = ROOT / "README.md") -> list[str]:
    """Every bad reference of one page, as ``"<kind>: <what>"`` lines."""
    problems: list[str] = []
    code, prose = split_markdown(text)
    where = source.parent

    # links (relative ones; anchors too)
    for m in _LINK_RE.finditer(prose):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.\-]*:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (where / file).resolve()
        if file and not dest.exists():
            problems.append(f"link: {target} does not exist")
        elif anchor and (not file or dest.suffix == ".md"):
            if anchor not in anchors(dest.read_text() if file else text):
                problems.append(f"link: {target}: no heading with anchor #{anchor}")

    # repository paths, in code and in prose (link targets are relative: left to the above)
    prose_wo_links = _LINK_RE.sub(" ", prose)
    for piece in code + [prose_wo_links]:
        for m in _PATH_RE.finditer(piece):
            p = m.group(1).rstrip(".,:;")
            if _PLACEHOLDER.search(p):
                continue
            if not (ROOT / p).exists():
                problems.append(f"path: {p} does not exist")

    for piece in code:
        for m in _MODULE_RE.finditer(piece):
            if piece[m.end():m.end() + 1] == "<":
                continue  # python -m oases.<command>: a placeholder
            if not runnable_module(m.group(1).rstrip(".")):
                problems.append(f"module: python -m {m.group(1)}: no such runnable module")
        for m in _DOTTED_RE.finditer(piece):
            name = m.group(1).rstrip(".")
            if name.split(".")[-1] in _FILE_EXTS or re.search(r"-m\s+$", piece[:m.start()]):
                continue  # a file name, or a `python -m` module (checked above)
            why = dotted_problem(name)
            if why:
                problems.append(f"name: {why}")
        for m in _MAKE_RE.finditer(piece):
            for arg in m.group(1).split():
                if "=" in arg or arg.startswith("-"):
                    continue
                if arg not in make_targets():
                    problems.append(f"make: no target {arg!r} in the Makefile")
        for m in _SUB_RE.finditer(piece):
            cmds = cli_commands()  # None or empty: test_console_script_commands skips
            if cmds and m.group(1) not in cmds:
                problems.append(f"command: oases {m.group(1)} is not a command of the "
                                f"console script ({', '.join(sorted(cmds))})")
        for m in _KEY_RE.finditer(piece):
            sec, key = m.groups()
            quoted = piece[m.start() - 1:m.start()] == piece[m.end():m.end() + 1] == "'"
            if key in _FILE_EXTS or quoted:
                continue  # a file name, or a bad key quoted in an error message
            if key not in config_fields()[sec]:
                problems.append(f"config: {sec}.{key} is not a field of the {sec} section")
    return problems


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


# --------------------------------------------------------------------------- the pages

def test_pages_exist():
    names = {p.name for p in PAGES if p.parent.name == "docs"}
    expected = {"README.md", "architecture.md", "training.md", "data.md", "hf.md",
                "checkpoints.md", "overlap.md", "pipelines.md", "zero.md", "planner.md",
                "custom-blocks.md", "benchmarks.md", "troubleshooting.md", "exit-statuses.md"}
    assert expected <= names, f"missing docs pages: {sorted(expected - names)}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_page_references(page: Path):
    problems = check_markdown(page.read_text(), page)
    assert not problems, f"{_rel(page)}:\n  " + "\n  ".join(problems)


def test_every_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = {m.group(1).partition("#")[0] for m in _LINK_RE.finditer(index)}
    missing = [p.name for p in PAGES if p.parent.name == "docs" and p.name != "README.md"
               and p.name not in linked]
    assert not missing, f"docs/README.md does not link {missing}"


def test_readme_length():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines (at most 250: details belong in docs/)"


def test_console_script_commands():
    cmds = cli_commands()
    if cmds is None:
        pytest.skip("oases/cli/__main__.py does not exist: no console-script table to check")
    if not cmds:
        pytest.skip("oases/cli/__main__.py has no table of command names this test can read")
    assert {"train", "plan"} <= cmds


# --------------------------------------------------------------------------- the checker itself

# kind of bad reference -> (markdown with exactly one, the start of the problem reported)
BAD = {
    "path": ("See `oases/schedule/engines.py` for the engines.", "path:"),
    "path-folder": ("The loop lives in `oases/nosuch/`.", "path:"),
    "path-prose": ("Read oases/runtime/nosuch.py first.", "path:"),
    "module": ("```bash\npython -m oases.nosuch --config configs/gpt.yaml\n```", "module:"),
    "module-package": ("Run `python -m oases.runtime`.", "module:"),  # a package, no __main__
    "name": ("Blocks subclass `oases.schedule.block.TPBlock`.", "name:"),
    "name-attr": ("Blocks subclass `oases.parallel.block.NoSuchBlock`.", "name:"),
    "name-method": ("See `oases.planner.cost.CostModel.no_such_cost`.", "name:"),
    "name-benchmark": ("Run `benchmarks.nosuch`.", "name:"),
    "make": ("Run `make trian`.", "make:"),
    "config": ("```bash\ntorchrun train.py --config configs/gpt.yaml parallel.tpp=2\n```",
               "config:"),
    "config-span": ("Set `train.stpes` to 10.", "config:"),
    "link": ("See [the planner](docs/nosuch.md).", "link:"),
    "anchor": ("See [the planner](docs/planner.md#no-such-heading).", "link:"),
    "anchor-here": ("See [above](#no-such-heading).", "link:"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_checker_reports_a_bad_reference(kind: str):
    text, expected = BAD[kind]
    problems = check_markdown("# A page\n\nSome text.\n\n" + text + "\n", ROOT / "README.md")
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_checker_reports_a_bad_command():
    cmds = cli_commands()
    if not cmds:
        pytest.skip("no console-script table in oases/cli/__main__.py")
    problems = check_markdown("```bash\noases trian --config configs/gpt.yaml\n```\n")
    assert len(problems) == 1 and problems[0].startswith("command"), problems


GOOD = """\
# Title

Start with `train.py`, then `oases/runtime/trainer.py` and the folder `oases/parallel/`.
Weights go to `model.safetensors`, tokens to `data/pydoc/train.bin` and `train.bin`.
`model.load_state_dict(torch.load("model.pt"))`, `oases.parallel.block.TPBlock`,
`oases.parallel.init_parameters`, `oases.runtime.trainer`, `parallel.tp`, `data.train_paths`.
Paths with placeholders: `configs/cluster/<name>.yaml`, `trace_rank*.json`, `runs/x/metrics.jsonl`.
A link to [the overlap results](benchmarks/results/overlap.md) and [a heading](#title).

```bash
make train CONFIG=configs/llama-tiny.yaml ARGS="train.steps=50 parallel.tp=1"
make test
python -m oases.plan --config configs/gpt.yaml --out plan.yaml
python -m pytest -q tests
torchrun --nproc_per_node 2 train.py --config configs/gpt-tiny.yaml model.init_from=hf:/models/gpt2
```
"""


def test_checker_accepts_good_references():
    assert check_markdown(GOOD, ROOT / "README.md") == []
