"""The public API: what ``import kvbridge`` exposes (at most 25 names, each documented, each visible to a
type checker), and the named public modules holding the rest (``kvbridge.failures``,
``kvbridge.integrations``, ``kvbridge.modes``)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvbridge

INIT = Path(kvbridge.__file__)


def test_at_most_25_names_each_documented_in_the_package_docstring():
    names = kvbridge.__all__
    assert len(names) == len(set(names)) <= 25, names
    assert sorted(dir(kvbridge)) == sorted(names)
    for n in names:
        obj = getattr(kvbridge, n)
        assert inspect.getdoc(obj), f"kvbridge.{n} has no docstring"
        assert n in kvbridge.__doc__, f"kvbridge.{n} is not described in the package docstring"


def test_lazy_names_are_visible_to_type_checkers():
    """Names loaded on first use are imported under TYPE_CHECKING too, so a type checker sees the classes."""
    tree = ast.parse(INIT.read_text())
    checked = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom):
                    checked |= {a.asname or a.name for a in imp.names}
    assert set(kvbridge._LAZY) <= checked, set(kvbridge._LAZY) - checked
    assert (INIT.parent / "py.typed").exists()


def test_read_failures_and_integration_helpers_live_in_named_modules():
    from kvbridge import failures, integrations, modes

    for n in failures.__all__:
        cls = getattr(failures, n)
        assert issubclass(cls, kvbridge.ReadFailure) and inspect.getdoc(cls), n
        assert n not in kvbridge.__all__ or n == "ReadFailure"
        assert f":class:`{n}`" in failures.__doc__, n
    assert {"from_hf_config", "CacheGroup", "MambaSpec", "dtype_size", "nixl_transport"} <= set(integrations.__all__)
    for n in integrations.__all__:
        assert inspect.getdoc(getattr(integrations, n)), n
    assert integrations.dtype_size("bfloat16") == 2
    assert modes.parse_mode("staged") is modes.TransferPath.STAGED and modes.parse_mode("auto") == modes.AUTO
