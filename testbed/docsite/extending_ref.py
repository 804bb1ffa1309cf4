"""What extending the testbed touches, read from the code: the members of each kind (policies,
fault kinds, trace formats, prefill models, backends) and every place that dispatches over one
(each `match` over a kind ends in `unknown_kind(family, ...)`, see `testbed.core.schema.kinds`), so the
list of places a new member needs is the list of those calls."""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from testbed.core.schema.scenario import FaultKind, PolicyName
from testbed.deploy import registry
from testbed.traces.formats import SUPPORTED_FORMATS

PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Site:
    family: str  # "policy", "fault kind", ...
    path: str  # testbed/core/routing/policy.py
    line: int
    function: str  # the enclosing function or method


def dispatch_sites() -> dict[str, list[Site]]:
    """family -> every `unknown_kind("family", ...)` call in the package, in file order."""
    out: dict[str, list[Site]] = defaultdict(list)
    for f in sorted(PACKAGE.rglob("*.py")):
        if f.name == "kinds.py" and f.parent.name == "schema":
            continue
        _visit(ast.parse(f.read_text(), str(f)), str(f.relative_to(PACKAGE.parent)), [], out)
    return dict(out)


def _visit(node: ast.AST, path: str, stack: list[str], out: dict[str, list[Site]]) -> None:
    """Record the `unknown_kind` calls under `node`; `stack` holds the enclosing function/class names."""
    named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        stack.append(node.name)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "unknown_kind"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        out[node.args[0].value].append(Site(node.args[0].value, path, node.lineno, ".".join(stack) or "<module>"))
    for child in ast.iter_child_nodes(node):
        _visit(child, path, stack, out)
    if named:
        stack.pop()


def members() -> dict[str, tuple[str, ...]]:
    """The members each family has now."""
    from testbed.core.schema.hardware import PrefillSpec

    prefill = tuple(str(get_args(m.model_fields["kind"].annotation)[0]) for m in get_args(get_args(PrefillSpec)[0]))
    return {
        "policy": tuple(get_args(PolicyName)),
        "fault kind": tuple(get_args(FaultKind)),
        "trace format": tuple(SUPPORTED_FORMATS),
        "prefill model": prefill,
        "backend": tuple(registry.names()),
    }


def sites_list(family: str) -> str:
    sites = dispatch_sites().get(family, [])
    if not sites:
        return "(no dispatch over this kind in the code)"
    return "\n".join(f"- `{s.path}:{s.line}`, in `{s.function}`" for s in sites)
