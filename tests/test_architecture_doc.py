"""docs/architecture.md stays true of the tree: every product module and package folder is named in its map,
and every file or folder the page names exists.

The map is the page's first code block, an indented tree:

    trainguard/              THE CORE: ...                     a top-level folder (column 0)
      tls.py                 TLS v1 encode/decode ...          an entry of it (its names, then a description)
      paths.py, node.py      user-named paths ...              several names in one entry
      decide/                PURE decision logic ...           a package, whose entries are indented once more
        guard.py             gradient-health guard ...
      replay/                source.py (...) -> picking.py ... a package may name its modules in its text instead

A module is named when `<module>.py` is written in the entry of its folder or in an entry directly under it
(its name column or its description); a package when `<package>/` is the name of an entry under its parent.
`__init__.py` is its package's; a collector's module (agent/collectors/) may be left to docs/collectors.md,
whose section per collector of the registry is held to the golden expositions. The product is what setup.py installs (its ROOTS). Names in an entry's name
column must exist in that folder; any other `*.py` or `folder/` the page mentions (`decide/stall.py`,
`trainguard/*_cli.py`) must exist somewhere in the repository.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
COLLECTORS_DOC = ROOT / "docs" / "collectors.md"
COLLECTORS = Path("agent") / "collectors"
DESCRIPTION_COLUMN = 20        # an entry's names start left of this; its continuation lines right of it
PY_NAME = re.compile(r"(?<![\w./*<>-])([\w*]+\.py)\b")
PATH_NAME = re.compile(r"(?<![\w./*-])((?:[\w*-]+/)+[\w*.-]*)")


def product_roots() -> dict[str, Path]:
    """{import name: folder} of what setup.py installs."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ROOTS" for t in node.targets):
            return {name: ROOT / folder for name, folder in ast.literal_eval(node.value).items()}
    raise AssertionError("setup.py: no ROOTS")


def product_packages() -> list[Path]:
    """Every folder of the product holding Python modules (the roots and their packages)."""
    folders = set()
    for root in product_roots().values():
        folders |= {path.parent for path in root.rglob("*.py") if "__pycache__" not in path.parts}
    return sorted(folders)


@dataclass
class Entry:
    """One line of the map that starts a name (and its continuation lines)."""
    indent: int
    names: list[str]
    text: str
    children: list["Entry"] = field(default_factory=list)


def map_block(text: str) -> list[str]:
    block = text.split("```", 2)[1]
    return block.split("\n")[1:]


def parse_map(lines: list[str]) -> list[Entry]:
    """The map as a forest of entries, by indentation."""
    tops: list[Entry] = []
    stack: list[Entry] = []
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent >= DESCRIPTION_COLUMN and stack:
            stack[-1].text += " " + line.strip()
            continue
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        head = re.sub(r"\(.*", "", head)         # "preflight/ (installed as ...)" names preflight/
        names = [name.strip() for name in head.split(",") if name.strip()]
        entry = Entry(indent, names, line.strip())
        while stack and stack[-1].indent >= indent:
            stack.pop()
        (stack[-1].children if stack else tops).append(entry)
        stack.append(entry)
    return tops


def folder_entries(tops: list[Entry]) -> dict[Path, Entry]:
    """{folder: its entry} for every entry that names a folder, resolved from the repository root."""
    found: dict[Path, Entry] = {}

    def walk(entries: list[Entry], parent: Path) -> None:
        for entry in entries:
            for name in entry.names:
                if name.endswith("/"):
                    found[parent / name.rstrip("/")] = entry
                    walk(entry.children, parent / name.rstrip("/"))
    walk(tops, ROOT)
    return found


def named_in(entry: Entry) -> str:
    """What counts as naming a module of the entry's folder: its own text and its direct entries'."""
    return " ".join([entry.text, *(child.text for child in entry.children)])


FOLDERS = folder_entries(parse_map(map_block(DOC.read_text())))


def collector_modules() -> dict[str, str]:
    """{module file name: collector name} of agent/collectors/: the map leaves these to docs/collectors.md,
    which has a section per collector of the registry (tests/agent/test_golden.py)."""
    import trainguard.agent.collectors  # noqa: F401 - imports every collector module, so each registers
    from trainguard.agent.collector import REGISTRY

    return {cls.__module__.rsplit(".", 1)[1] + ".py": name for name, cls in REGISTRY.items()}


def described_in_the_collectors_doc(module: str) -> bool:
    name = collector_modules().get(module)
    headings = {line[3:].split(" ")[0] for line in COLLECTORS_DOC.read_text().splitlines() if line.startswith("## ")}
    return name is not None and name in headings


@pytest.mark.parametrize("package", product_packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_product_package_and_module_is_named_in_the_map(package):
    rel = package.relative_to(ROOT)
    assert package in FOLDERS, f"{DOC}: the map has no entry '{package.name}/' for {rel}/ under its parent"
    text = named_in(FOLDERS[package])
    named = set(PY_NAME.findall(text))
    modules = sorted(path.name for path in package.glob("*.py") if path.name != "__init__.py")
    if rel == COLLECTORS:
        modules = [name for name in modules if not described_in_the_collectors_doc(name)]
    missing = [name for name in modules if name not in named]
    assert not missing, f"{DOC}: the entry of {rel}/ (or one directly under it) does not name {missing}"


def test_every_name_in_an_entry_exists_in_its_folder():
    missing = []
    for folder, entry in FOLDERS.items():
        if not folder.is_dir():
            missing.append(f"{folder.relative_to(ROOT)}/")
        for child in entry.children:
            missing += [f"{folder.relative_to(ROOT)}/{name}" for name in child.names
                        if re.fullmatch(r"[\w.-]+(/|\.py)?", name) and not (folder / name.rstrip("/")).exists()]
    assert not missing, f"{DOC}: the map names what is not there: {missing}"


def candidates(name: str) -> list[Path]:
    """Where a name the page mentions may be: from the repository root, or from any product root."""
    bases = [ROOT, *product_roots().values()]
    return [path for base in bases for path in base.glob(name.rstrip("/"))]


def test_every_file_and_folder_the_page_mentions_exists():
    text = DOC.read_text()
    everything = {path.name for path in ROOT.rglob("*.py") if ".venv" not in path.parts}
    missing = sorted({name for name in PY_NAME.findall(text) if "*" not in name and name not in everything})
    for name in set(PATH_NAME.findall(text)):
        if name.startswith(("RUN/", "http", "~", "/")) or "<" in name or not name.endswith(("/", ".py", ".md", ".yml", ".yaml", ".json")):
            continue
        first = name.split("/")[0]
        if not (ROOT / first).exists() and not any((root / first).exists() for root in product_roots().values()):
            continue     # not a path of this repository (`control/actions.jsonl` under RUN, `tls/1`)
        if not candidates(name):
            missing.append(name)
    assert not missing, f"{DOC} mentions files or folders that do not exist: {sorted(missing)}"


def test_the_checks_can_fail():
    """A module the map leaves out, and a name in the map with nothing behind it, are found."""
    lines = ["trainguard/              the core", "  tls.py                 TLS", "  gone.py                not here",
             "  decide/                pure", "    guard.py             the guard"]
    folders = folder_entries(parse_map(lines))
    decide = folders[ROOT / "trainguard" / "decide"]
    assert "guard.py" in named_in(decide) and "ledger.py" not in PY_NAME.findall(named_in(decide))
    core = folders[ROOT / "trainguard"]
    assert [child.names for child in core.children] == [["tls.py"], ["gone.py"], ["decide/"]]
    assert not (ROOT / "trainguard" / "gone.py").exists()
