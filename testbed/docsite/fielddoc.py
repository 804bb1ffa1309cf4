"""What the code says about each field of a class, and the rows of a pydantic model's fields.

A field's documentation is read from its class's source, in this order: pydantic's
`description`, a string literal right after the field (an attribute docstring), the comment on
the field's own line(s), else the block of comment lines directly above it. Base classes are
read too (a subclass's words win). A field the code says nothing about takes its text from
`notes.NOTES`, the reference's own words; a `_wire` field without words takes its `_paper`
twin's.
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from testbed.docsite.notes import NOTES


def _comments(src: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text, whether the line holds nothing else)."""
    out: dict[int, tuple[str, bool]] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = (tok.string.lstrip("#").strip(), False)
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return {n: (text, n not in code_lines) for n, (text, _) in out.items()}


@cache
def _own_docs(cls: type) -> dict[str, str]:
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(src)
    node = tree.body[0]
    if not isinstance(node, ast.ClassDef):
        return {}
    comments = _comments(src)
    out: dict[str, str] = {}
    body = node.body
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            out[name] = inspect.cleandoc(nxt.value.value)
            continue
        end = stmt.end_lineno or stmt.lineno
        trailing = [comments[n][0] for n in range(stmt.lineno, end + 1) if n in comments and not comments[n][1]]
        if trailing:
            out[name] = " ".join(trailing)
            continue
        above: list[str] = []
        n = stmt.lineno - 1
        while n in comments and comments[n][1]:
            above.insert(0, comments[n][0])
            n -= 1
        if above:
            out[name] = " ".join(above)
    return out


def source_docs(cls: type) -> dict[str, str]:
    """Field name -> what the source says about it, for `cls` and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("testbed."):
            out.update(_own_docs(klass))
    return out


def sentence(text: str) -> str:
    """Words read from a comment as a table cell reads them: a capital first letter."""
    return text[:1].upper() + text[1:] if text[:1].islower() else text


def field_doc(cls: type, name: str, info: FieldInfo | None = None) -> str:
    """The documentation of field `name` of `cls` ("" when nothing says anything)."""
    return sentence(_field_doc(cls, name, info))


def _field_doc(cls: type, name: str, info: FieldInfo | None = None) -> str:
    if info is not None and info.description:
        return info.description
    docs = source_docs(cls)
    if name in docs:
        return docs[name]
    for klass in cls.__mro__:
        note = NOTES.get(f"{klass.__module__}.{klass.__qualname__}.{name}")
        if note:
            return note
    if name.endswith("_wire"):
        twin = name.removesuffix("_wire") + "_paper"
        fields = getattr(cls, "model_fields", None)
        if isinstance(fields, Mapping) and twin in fields or twin in docs:
            base = _field_doc(cls, twin, fields.get(twin) if isinstance(fields, Mapping) else None)
            return f"{base} In wire units." if base else ""
    return ""


# -- types, defaults, constraints ---------------------------------------------------------


def type_name(tp: Any) -> str:
    """A short, readable name of an annotation."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin = get_origin(tp)
    args = get_args(tp)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " \\| ".join(repr(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin in (list, tuple, dict, set, frozenset):
        label = {list: "list", tuple: "tuple", dict: "map", set: "set", frozenset: "set"}[origin]
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"list[{type_name(args[0])}]"
        return f"{label}[{', '.join(type_name(a) for a in args)}]" if args else label
    if isinstance(tp, type):
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(tp.__name__, tp.__name__)
    return str(tp)


def default_text(info: FieldInfo) -> str:
    """The default as a reader would write it in YAML; "required" when there is none."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(its fields' defaults)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"{value:.6g}"
    if isinstance(value, (list, dict, tuple)) and not value:
        return "[]" if not isinstance(value, dict) else "{}"
    return repr(value) if isinstance(value, str) else str(value)


def _bound(c: object) -> str | None:
    if isinstance(c, at.Gt):
        return f"> {c.gt}"
    if isinstance(c, at.Ge):
        return f">= {c.ge}"
    if isinstance(c, at.Lt):
        return f"< {c.lt}"
    if isinstance(c, at.Le):
        return f"<= {c.le}"
    if isinstance(c, at.MinLen):
        return f"at least {c.min_length} item(s)"
    if isinstance(c, at.MaxLen):
        return f"at most {c.max_length} item(s)"
    pattern = getattr(c, "pattern", None)
    if isinstance(pattern, str):
        return f"matches `{pattern}`"
    if getattr(c, "allow_inf_nan", None) is False:
        return "finite"
    return None


def constraints(info: FieldInfo) -> str:
    return ", ".join(b for c in info.metadata if (b := _bound(c)) is not None)


# -- walking models ------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldRow:
    path: str  # dotted, `[]` for list items, `<name>` for map keys
    typename: str
    default: str
    constraints: str
    doc: str
    owner: str  # the model class that declares it
    model: type[BaseModel] | None  # the nested model (a section), if any
    variant: str = ""  # for a member of a union of models: its `kind` (else its class name)


def _models_in(tp: Any) -> list[tuple[str, type[BaseModel]]]:
    """The models an annotation holds, each with the path suffix that reaches it: '' (the field
    itself), '[]' (list items), '.<name>' (map values)."""
    origin = get_origin(tp)
    args = get_args(tp)
    if origin is typing.Annotated:
        return _models_in(args[0])
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [("", tp)]
    if origin in (Union, types.UnionType):
        return [m for a in args for m in _models_in(a)]
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return [("[]" + s, m) for s, m in _models_in(args[0])]
    if origin is dict and len(args) == 2:
        return [(".<name>" + s, m) for s, m in _models_in(args[1])]
    return []


def class_doc(cls: type) -> str:
    """The first paragraph of a class's own docstring ("" when it has none of its own)."""
    doc = cls.__dict__.get("__doc__")
    if not isinstance(doc, str) or not doc.strip():
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def variant_name(model: type[BaseModel]) -> str:
    """A union member's name: the value of its `kind` Literal, else its class name."""
    kind = model.model_fields.get("kind")
    if kind is not None and get_origin(kind.annotation) is Literal:
        args = get_args(kind.annotation)
        if len(args) == 1:
            return str(args[0])
    return model.__name__


def model_rows(model: type[BaseModel], prefix: str = "", variant: str = "") -> Iterator[FieldRow]:
    """Every field of `model` and of the models it nests, depth first, in declaration order.
    A union of models (a discriminated `kind`) lists each member's fields under the same path,
    each row naming its member (`variant`)."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        path = f"{prefix}{key}"
        nested = _models_in(info.annotation)
        doc = field_doc(model, name, info)
        if not doc and len(nested) == 1:
            doc = class_doc(nested[0][1])
        if not doc and name == "kind" and variant:
            doc = class_doc(model)  # a union member's discriminator: what the member is
        yield FieldRow(
            path,
            type_name(info.annotation),
            default_text(info),
            constraints(info),
            doc,
            model.__name__,
            nested[0][1] if len(nested) == 1 else None,
            variant,
        )
        for suffix, sub in nested:
            yield from model_rows(sub, f"{path}{suffix}.", variant_name(sub) if len(nested) > 1 else variant)


def model_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    return {r.path for r in model_rows(model, prefix)}
