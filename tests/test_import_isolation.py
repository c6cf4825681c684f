"""Core separate from the harness (issue 11 point 4).

Every core module, imported alone in a fresh interpreter, loads no harness module (``kvbridge.testing``),
no benchmark code (anything from ``benchmarks/``), and neither torch nor rich; the CLI may load rich
(its tables) but nothing else of those. Plus a static check that no module of the package or of
``benchmarks/`` reaches for another module's private (``_underscore``) names.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvbridge"
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> list[str]:
    out = []
    for f in sorted(SRC.rglob("*.py")):
        name = _module_name(f)
        if name.startswith(("kvbridge.testing", "kvbridge.integrations")):
            continue  # the harness itself; engine integrations import their engine
        out.append(name)
    return out


CORE = _modules()

# Imports ``module`` (and, for the package, every public name, which loads the lazy runtime classes),
# then prints what was loaded that the core must not need.
_PROBE = """
import importlib, json, sys
mod = importlib.import_module({name!r})
if {name!r} == "kvbridge":
    for n in getattr(mod, "__all__", ()):
        getattr(mod, n)
bench = {bench!r}
loaded = []
for k, m in list(sys.modules.items()):
    f = getattr(m, "__file__", None) or ""
    if (k.startswith("kvbridge.testing") or k in ("torch", "rich") or k.startswith(("torch.", "rich."))
            or k == "benchmarks" or k.startswith("benchmarks.") or (f and f.startswith(bench))):
        loaded.append(k)
print(json.dumps(sorted(loaded)))
"""


def test_every_core_module_is_listed():
    assert "kvbridge.lower" in CORE and "kvbridge.runtime.decode" in CORE and "kvbridge.transport.nixl" in CORE
    assert not any(m.startswith("kvbridge.testing") for m in CORE)


@pytest.mark.parametrize("name", CORE)
def test_core_module_imports_no_harness(name):
    code = _PROBE.format(name=name, bench=str(BENCH))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=None, cwd=str(SRC.parents[1]))
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    if name == "kvbridge.cli":  # the CLI prints with rich; it still must not load the harness at import
        loaded = [m for m in loaded if m != "rich" and not m.startswith("rich.")]
    assert loaded == [], f"importing {name} loaded {loaded}"


# ---- no cross-module private access -------------------------------------------------------------
def _names_defined(tree: ast.AST) -> set[str]:
    """Every name a module defines or binds (functions, classes, attributes it assigns, arguments,
    ``__slots__`` strings): private names outside this set belong to another module."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            out.add(n.value)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    own = _names_defined(tree)
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            bad += [f"{path.name}:{n.lineno}: from {n.module} import {a.name}" for a in n.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
              and n.attr not in own):
            bad.append(f"{path.name}:{n.lineno}: .{n.attr}")
    return bad


def test_no_module_uses_another_modules_private_names():
    # kvbridge.integrations.* subclass an engine's connector base class and use the attributes it sets
    files = [f for f in sorted(SRC.rglob("*.py")) if "integrations" not in f.parts] + sorted(BENCH.glob("*.py"))
    bad = [b for f in files for b in _private_uses(f)]
    assert bad == [], "private names of other modules used:\n" + "\n".join(bad)
