"""Every product module reads run-directory files through trainguard/safe_read.py, and nothing else.

A reader that opens a file its own way can be frozen by a FIFO put in the file's place, or made to read
/dev/zero until memory runs out (`incident.json`, `manifest.json`, `extra.pt`). This test scans
the product's source for every way Python opens or reads a file (open(), Path.read_text/read_bytes/open,
json.load, yaml loading, gzip/zstd/mmap openers, os.open for reading, shutil.copyfile) and fails on any
call not in ALLOWED below, where each entry says why that call may read outside safe_read: it writes, or
what it reads is not in the run directory.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("trainguard", "runtime", "agent", "trainer", "protect", "preflight", "demo")

# (file, enclosing function, call): why it is not a run-directory read. "<module>" is module level.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("trainguard/safe_read.py", "open_fd", "os.open"): "the safe reader itself: O_NONBLOCK, then fstat",
    ("trainguard/safe_read.py", "open_rw_fd", "os.open"): "the safe reader itself: O_NONBLOCK, then fstat",
    ("trainguard/safe_read.py", "open_file", "os.fdopen"): "the safe reader itself, over a checked descriptor",
    ("trainguard/safe_read.py", "open_append", "os.fdopen"): "the safe reader itself, over a checked descriptor",
    ("trainguard/replay/replica.py", "_may_hold_checks", "mmap.mmap"): "maps a file safe_read opened",
    ("trainguard/replay/node_risk.py", "_may_hold_health", "mmap.mmap"): "maps a file safe_read opened",
    ("trainguard/formats/tensorboard.py", "records", "mmap.mmap"): "maps an event file safe_read opened",
    ("trainguard/report/html.py", "render", "read_text"): "the report's CSS, shipped in the package",
    ("trainguard/report/html.py", "render", "read_text#2"): "the report's JS, shipped in the package",
    ("trainguard/cli.py", "main", "os.open"): "os.devnull, for writing (stdout of a closed pipe)",
    ("trainguard/cordon/__init__.py", "revoke", "os.open"): "the lock beside the key file, outside the run directory",
    ("trainguard/cordon/__init__.py", "_write_private", "os.open"): "the revocation list beside the key file, outside "
                                                          "the run directory (written)",
    ("trainguard/cordon/__init__.py", "_write_private", "os.open#2"): "its directory, opened to fsync it",
    ("trainguard/incidents/__init__.py", "_fsync_dir", "os.open"): "a directory, opened to fsync it",
    ("agent/collectors/xid.py", "KmsgSource.__init__", "os.open"): "/dev/kmsg (O_NONBLOCK on purpose)",
    ("agent/procfs.py", "read_small", "os.open"): "/proc files",
    ("agent/restore.py", "_open_for_writing", "open"): "/proc/<pid>/fdinfo/<fd>",
    ("agent/procfs.py", "_sys_read", "read_text"): "/sys files",
    ("agent/versions.py", "torch_cuda_version", "read_text"): "an installed package's version.py",
    ("agent/versions.py", "driver_version", "read_text"): "/sys/module/nvidia/version",
    ("agent/versions.py", "driver_version", "read_text#2"): "/proc/driver/nvidia/version",
    ("agent/versions.py", "kernel_version", "read_text"): "/proc/sys/kernel/osrelease",
    ("runtime/telemetry.py", "MemoryProbe.__init__", "os.open"): "/proc/self/statm",
    ("runtime/checkpoint/keys.py", "_write_private", "os.open"): "writes the key (outside the run directory)",
    ("trainer/data.py", "tokenize_dir", "read_bytes"): "the user's corpus, outside the run directory",
    ("trainer/data.py", "TokenStream.__init__", "np.memmap"): "the token shards, outside the run directory",
    ("runtime/resilience/snapshot.py", "_write_new", "os.open"): "writes an in-memory snapshot (O_NOFOLLOW, 0600)",
    ("runtime/resilience/replicate.py", "Replicator._commit", "os.open"): "writes a received replica (O_NOFOLLOW, 0600, hashed while written)",
    ("runtime/resilience/sockets.py", "established", "open"): "/proc/self/net/tcp: this process's connections",
    ("trainer/faults.py", "FaultInjector.after_checkpoint", "open"): "the corrupt-checkpoint fault: writes a "
                                                                     "byte into a checkpoint on purpose",
}

READ_METHODS = {"read_text", "read_bytes"}
MODULE_CALLS = {("json", "load"), ("gzip", "open"), ("io", "open"), ("os", "open"), ("os", "fdopen"),
                ("mmap", "mmap"), ("shutil", "copyfile"), ("np", "memmap"), ("numpy", "memmap"), ("lzma", "open"),
                ("bz2", "open"), ("zstandard", "open")}
YAML_LOADERS = {"safe_load", "load", "full_load", "unsafe_load", "load_all", "safe_load_all"}


def _calls(tree: ast.AST):
    """(enclosing function, call name, line) of every file-reading call in `tree`."""
    found = []

    def visit(node, where: str, in_class: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # a method is Class.method; a nested function counts as the function it is in
                inner = f"{where}.{child.name}" if in_class else child.name if where == "<module>" else where
                visit(child, inner, False)
            elif isinstance(child, ast.ClassDef):
                visit(child, child.name, True)
            else:
                if isinstance(child, ast.Call):
                    name = _name(child.func)
                    if name and not _writes(child, name):
                        found.append((where, name, child.lineno))
                visit(child, where, in_class)

    visit(tree, "<module>", False)
    return found


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name) and func.id == "open":
        return "open"
    if isinstance(func, ast.Attribute):
        base = func.value.id if isinstance(func.value, ast.Name) else None
        if base == "safe_read":
            return None
        if base == "yaml" and func.attr in YAML_LOADERS:
            return "yaml"
        if (base, func.attr) in MODULE_CALLS:
            return f"{base}.{func.attr}"
        if func.attr in READ_METHODS:
            return func.attr
        if func.attr == "open" and base not in ("safe_read", "os", "gzip", "io", "tarfile", "webbrowser"):
            return "open"        # Path.open()
    return None


def _writes(call: ast.Call, name: str) -> bool:
    """A write that cannot meet a FIFO someone put in its place: a new file (open's mode x, os.open's
    O_EXCL) or a directory (O_DIRECTORY, to fsync it); open's w and a modes (which block on a FIFO as a read
    does) are let through: they write trainguard's own temporary names and outputs. An os.open of a
    well-known name to append (O_WRONLY|O_APPEND: acks, events) goes through safe_read.open_rw_fd."""
    if name in ("open", "gzip.open", "io.open", "os.fdopen"):
        modes = [arg for arg in call.args[1:2]] + [k.value for k in call.keywords if k.arg == "mode"]
        mode = modes[0].value if modes and isinstance(modes[0], ast.Constant) else "r"
        return isinstance(mode, str) and any(c in mode for c in "wax") and "+" not in mode
    if name == "os.open" and len(call.args) > 1:
        flags = ast.unparse(call.args[1])
        return "O_EXCL" in flags or "O_DIRECTORY" in flags
    return False


def offenders() -> list[str]:
    problems = []
    seen: set[tuple[str, str, str]] = set()
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            counts: dict[tuple[str, str], int] = {}
            for where, name, line in _calls(ast.parse(path.read_text(), relative)):
                counts[(where, name)] = counts.get((where, name), 0) + 1
                key = (relative, where, name if counts[(where, name)] == 1 else f"{name}#{counts[(where, name)]}")
                seen.add(key)
                if key not in ALLOWED:
                    problems.append(f"{relative}:{line}: {name}() in {where}")
    stale = [f"{key}: allowed but no longer there" for key in ALLOWED if key not in seen]
    return problems + stale


def test_every_reader_of_a_run_directory_file_goes_through_safe_read():
    problems = offenders()
    assert not problems, ("read these through trainguard.safe_read (or add an ALLOWED entry saying why the "
                          "file is not in the run directory, or is written):\n" + "\n".join(problems))


def test_the_scan_finds_a_plain_open_and_a_read_text(tmp_path):
    """The scan is not blind: the shapes the unsafe readers once had are found."""
    tree = ast.parse("import json\n"
                     "def read(path):\n"
                     "    with open(path, 'rb') as f:\n        return f.read()\n"
                     "class Reader:\n    def manifest(self):\n        return json.load(self.path.open())\n"
                     "def other(p):\n    return p.read_text()\n")
    names = {(where, name) for where, name, _ in _calls(tree)}
    assert {("read", "open"), ("Reader.manifest", "json.load"), ("Reader.manifest", "open"),
            ("other", "read_text")} <= names
