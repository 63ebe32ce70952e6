"""One owner per vocabulary: a name of the product's contracts is spelled once, in the module that owns it.

- the TLS event types (`event.type`): trainguard/event_types.py;
- the paths of the run directory (`step_<N>`, `logs/`, `cost_summary.json`, ...): trainguard/rundir.py.

Every other product module imports the name, so a reader finds each name's writers and readers with one
search and a new name is one line. `stray_literals` is the scanner: it takes the owner module and the set of
names and answers where else product code spells one (another vocabulary's test calls it the same way).
Docstrings, log messages and an option's help are prose and not scanned; tests may spell the contract.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from tests.test_layers import BUILDS_ON
from trainguard import event_types

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = tuple(BUILDS_ON)       # every top-level package of the product (tests/test_layers.py lists them)
LOG_LEVELS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical"})

# A Where answers whether a string constant (with its parent chain, nearest first) counts as a use of the
# vocabulary. The default counts every one but prose: docstrings, log messages, an option's help.
Where = Callable[[ast.Constant, list[ast.AST]], bool]


def product_files(roots: Iterable[str] = PRODUCT) -> list[Path]:
    return sorted(path for root in roots for path in (ROOT / root).rglob("*.py"))


class _Parsed:
    """One file's string constants (with their text), and each node's parent when first asked: every scan
    of a run reads each file once."""

    def __init__(self, path: Path):
        self.tree = ast.parse(path.read_bytes(), str(path))
        self.constants = [(node, text) for node in ast.walk(self.tree) if (text := _text(node)) is not None]
        self._parents: dict[int, ast.AST] | None = None

    def chain(self, node: ast.AST) -> list[ast.AST]:
        if self._parents is None:
            self._parents = _parents(self.tree)
        return _chain(node, self._parents)


@functools.lru_cache(maxsize=None)
def _parsed(path: Path, mtime_ns: int) -> _Parsed:
    return _Parsed(path)


def _parents(tree: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _chain(node: ast.AST, parents: dict[int, ast.AST]) -> list[ast.AST]:
    chain = []
    while id(node) in parents:
        node = parents[id(node)]
        chain.append(node)
    return chain


def _is_docstring(node: ast.Constant, chain: list[ast.AST]) -> bool:
    statement, owner = (chain + [None, None])[:2]
    return (isinstance(statement, ast.Expr)
            and isinstance(owner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and bool(owner.body) and owner.body[0] is statement)


def _is_log_message(node: ast.Constant, chain: list[ast.AST]) -> bool:
    call = chain[0] if chain else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr in LOG_LEVELS and bool(call.args) and call.args[0] is node)


def _is_help(node: ast.Constant, chain: list[ast.AST]) -> bool:
    """A command-line option's `help=` text."""
    holder = chain[1] if chain and isinstance(chain[0], ast.JoinedStr) and len(chain) > 1 else (chain or [None])[0]
    return isinstance(holder, ast.keyword) and holder.arg == "help"


def anywhere(node: ast.Constant, chain: list[ast.AST]) -> bool:
    return not (_is_docstring(node, chain) or _is_log_message(node, chain) or _is_help(node, chain))


def stray_literals(owner: str, words: Iterable[str] | re.Pattern, *, where: Where = anywhere,
                   files: Iterable[Path] | None = None, root: Path = ROOT) -> list[str]:
    """`file:line: 'text'` for every string constant equal to one of `words` (or, given a pattern, in which
    it is found) in product code outside `owner` (a path from the repository root, e.g.
    "trainguard/event_types.py") at a position `where` counts. A bytes constant counts as its text, without
    the quotes of a JSON string (`b'"word"'`, a scan mark); an f-string's literal parts count one by one.
    `files` (under `root`): the product's by default."""
    if isinstance(words, re.Pattern):
        pattern = words
        found_in = lambda text: pattern.search(text) is not None    # noqa: E731
    else:
        words = frozenset(words)
        found_in = words.__contains__
    found = []
    for path in product_files() if files is None else files:
        relative = path.relative_to(root).as_posix()
        if relative == owner:
            continue
        parsed = _parsed(path, path.stat().st_mtime_ns)
        for node, text in parsed.constants:
            if found_in(text) and where(node, parsed.chain(node)):
                found.append(f"{relative}:{node.lineno}: {text!r}")
    return found


def _text(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Constant):
        return None
    if isinstance(node.value, bytes):
        return node.value.decode("utf-8", "replace").removeprefix('"').removesuffix('"')
    return node.value if isinstance(node.value, str) else None


def quoted_bytes(node: ast.Constant, chain: list[ast.AST]) -> bool:
    """`b'"word"'`: the bytes a reader looks for in a JSON line, whatever the word's other meanings."""
    return isinstance(node.value, bytes) and node.value.startswith(b'"') and node.value.endswith(b'"')


# --------------------------------------------------------------------------------- TLS event types

def _reads_type(node: ast.AST) -> bool:
    """`x["type"]` or `x.get("type", ...)`: an event's type."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "type"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "type"
    return False


def event_type_position(node: ast.Constant, chain: list[ast.AST]) -> bool:
    """Where a string is an event's type: compared with one (alone or in a tuple/set/list), the value of a
    `"type"` key, or the first argument of `event(...)`, `emit(...)`, `on_event(...)`."""
    parent = chain[0] if chain else None
    if isinstance(parent, (ast.Tuple, ast.Set, ast.List)) and len(chain) > 1:
        parent, node = chain[1], parent      # an element of a collection compared with a type
        if not isinstance(parent, ast.Compare):
            return False
    if isinstance(parent, ast.Compare):
        operands = [parent.left, *parent.comparators]
        return any(_reads_type(other) for other in operands if other is not node)
    if isinstance(parent, ast.Dict):
        return any(value is node and isinstance(key, ast.Constant) and key.value == "type"
                   for key, value in zip(parent.keys, parent.values))
    if isinstance(parent, ast.Call) and parent.args and parent.args[0] is node:
        func = parent.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in ("event", "emit", "on_event")
    return False


# Event types that are also ordinary words of other vocabularies (an incident's `culprit`, the `cordon`
# command and folder, a policy's `evaluation`, a `layer_reinit` field, `action` and `alert` keys, the
# `replica_check` that detects a mismatch): only
# their use as an event's type is theirs.
SHARED_WORDS = frozenset({event_types.ACTION, event_types.ALERT, event_types.CULPRIT, event_types.CORDON,
                          event_types.EVALUATION, event_types.PREDICTION, event_types.LAYER_REINIT,
                          event_types.REPLICA_CHECK})
EVENTS_OWNER = "trainguard/event_types.py"
# Event types whose name the action table owns (event_types.py takes them from it): spelled in actions.py.
ACTIONS_OWNER = "trainguard/actions.py"
OWNED_BY_ACTIONS = frozenset({event_types.CORDON, event_types.SHADOW_ACTION})


def event_type_literals(files: Iterable[Path] | None = None, root: Path = ROOT) -> list[str]:
    files = product_files() if files is None else list(files)
    found = []
    for owner, words in ((EVENTS_OWNER, set(event_types.TYPES) - OWNED_BY_ACTIONS), (ACTIONS_OWNER, OWNED_BY_ACTIONS)):
        found += stray_literals(owner, words - SHARED_WORDS, files=files, root=root)
        found += stray_literals(owner, words, where=event_type_position, files=files, root=root)
        found += stray_literals(owner, words, where=quoted_bytes, files=files, root=root)
    return sorted(set(found), key=_by_place)


def _by_place(found: str) -> tuple[str, int, str]:
    path, line, word = found.split(":", 2)
    return path, int(line), word


def test_event_types_are_spelled_only_in_the_events_module():
    assert event_type_literals() == []


def test_the_event_type_scan_finds_a_planted_literal(tmp_path):
    planted = tmp_path / "trainguard" / "probe.py"
    planted.parent.mkdir()
    planted.write_text('"""A probe."""\n'
                       'SAVED = "checkpoint_saved"\n'
                       'def f(event, telemetry):\n'
                       '    """Says "run_start" in prose."""\n'
                       '    telemetry.log.info("run_end")\n'
                       '    telemetry.event("alert", step=1)\n'
                       '    return event.get("type") in ("action", "x") or {"type": "culprit"}\n'
                       'OTHER = {"action": 1, "alert": 2}\n')
    found = event_type_literals([planted], root=tmp_path)
    name = "trainguard/probe.py"
    assert found == [f"{name}:2: 'checkpoint_saved'", f"{name}:6: 'alert'", f"{name}:7: 'action'",
                     f"{name}:7: 'culprit'"]


def test_every_event_type_has_one_constant_and_is_in_types():
    constants = {name: value for name, value in vars(event_types).items()
                 if name.isupper() and isinstance(value, str)}
    assert sorted(constants.values()) == sorted(event_types.TYPES)
    assert len(set(event_types.TYPES)) == len(event_types.TYPES)


# ---------------------------------------------------------------------- paths of the run directory

RUNDIR_OWNER = "trainguard/rundir.py"
STEP_DIR = re.compile(r"(?<![a-z0-9_])step_(?![a-z_])")     # step_<N>, step_{n}, \Astep_(\d+), step_*
COST_SUMMARY = re.compile(r"cost_summary\.json")
# The run directory's files, spelled whole, and its folders joined to a path (`tls/1` is the TLS schema's name).
RUN_FILES = frozenset({"manifest.json", "status.json", "policy.yaml", "policy.sig.json", "preflight.json",
                       "report.html", "config.yaml", "stopped.json", "acked.jsonl", "actions.jsonl",
                       "webhook.token", "faults-fired.jsonl"})
RUN_FOLDERS = re.compile(r"\A(?:tls|checkpoints|control|agent|incidents|logs)(?:/(?!\d)|\Z)")


def joined_to_a_path(node: ast.Constant, chain: list[ast.AST]) -> bool:
    """`run_dir / "logs"`, or a relative path spelled whole: `"logs/**/*.log"`."""
    parent = chain[0] if chain else None
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return True
    return isinstance(node.value, str) and "/" in node.value and anywhere(node, chain)


def run_dir_literals(files: Iterable[Path] | None = None, root: Path = ROOT) -> list[str]:
    files = product_files() if files is None else list(files)
    found = (stray_literals(RUNDIR_OWNER, STEP_DIR, files=files, root=root)
             + stray_literals(RUNDIR_OWNER, COST_SUMMARY, files=files, root=root)
             + stray_literals(RUNDIR_OWNER, RUN_FILES, files=files, root=root)
             + stray_literals(RUNDIR_OWNER, RUN_FOLDERS, where=joined_to_a_path, files=files, root=root))
    return sorted(set(found), key=_by_place)


def test_run_directory_paths_are_spelled_only_in_rundir():
    assert run_dir_literals() == []


def test_the_run_directory_scan_finds_a_planted_literal(tmp_path):
    planted = tmp_path / "agent" / "probe.py"
    planted.parent.mkdir()
    planted.write_text('''"""Says step_<N> and logs/ in prose."""
import re
def f(run_dir, step, log, parser):
    log.info("saved step_%d", step)
    a = run_dir / "checkpoints" / f"step_{step}"
    b = re.fullmatch(r"step_(\\d+)", a.name)
    c = (run_dir / "logs", "logs/**/*.log", run_dir / "cost_summary.json")
    parser.add_argument("--to", help="copies into DIR/checkpoints/step_N")
    return a, b, c, "step_time_seconds", {"logs": "Logs"}, "logs", "tls/1", "config.yaml", "no RUN/config.yaml"
''')
    found = run_dir_literals([planted], root=tmp_path)
    name = "agent/probe.py"
    assert found == [f"{name}:5: 'checkpoints'", f"{name}:5: 'step_'", f"{name}:6: 'step_(\\\\d+)'",
                     f"{name}:7: 'cost_summary.json'", f"{name}:7: 'logs'", f"{name}:7: 'logs/**/*.log'",
                     f"{name}:9: 'config.yaml'"]
