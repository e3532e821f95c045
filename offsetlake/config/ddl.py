"""Spark SQL data types as pipeline YAML writes them (``long``, ``decimal(10,2)``,
``array<struct<a: int>>``): a small parser of Spark's DDL type grammar, so a typo fails when the
pipeline loads, naming the field, before anything is planned or read."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

# Spark SQL's type names (its DDL grammar; char/varchar read as string)
_PRIMITIVE_TYPES = {
    "string",
    "long",
    "bigint",
    "int",
    "integer",
    "short",
    "smallint",
    "byte",
    "tinyint",
    "double",
    "float",
    "real",
    "boolean",
    "timestamp",
    "timestamp_ltz",
    "timestamp_ntz",
    "date",
    "binary",
}
PARTITION_COLUMN_TYPES = {"string", "date", "int", "integer", "long", "bigint", "boolean"}


def spark_type_problem(text: str) -> str | None:
    """What is wrong with ``text`` as a Spark SQL data type (its DDL grammar), or None.

    Checked when a pipeline loads, so a typo (``array<strng>``), a precision Spark refuses
    (``decimal(40,2)``) or a struct field without a type fails naming the field, before anything
    is planned or read; the read step checks once more with Spark's own parser.
    """
    parser = _TypeParser(text)
    try:
        parser.type()
        parser.end()
    except ValueError as err:
        return str(err)
    return None


class _TypeParser:
    _TOKEN = re.compile(r"\s*(`[^`]*`|[A-Za-z_][A-Za-z0-9_]*|\d+|[<>(),:]|\S)")

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = [t for t in self._TOKEN.findall(text) if t.strip()]
        self.i = 0

    def peek(self) -> str:
        return self.tokens[self.i] if self.i < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if expected is not None and token.lower() != expected:
            raise ValueError(f"'{expected}' expected {self.where()}")
        if not token:
            raise ValueError("ends too early")
        self.i += 1
        return token

    def where(self) -> str:
        return f"at '{self.peek()}'" if self.peek() else "at its end"

    def end(self) -> None:
        if self.peek():
            raise ValueError(f"unexpected text {self.where()}")

    def type(self) -> None:
        """One data type; its name decides the grammar of what follows it."""
        name = self.take().lower()
        if name in _PRIMITIVE_TYPES:
            return
        parse_rest = self._COMPOSITES.get(name)
        if parse_rest is None:
            raise ValueError(
                f"unknown type '{name}' (Spark SQL types are e.g. string, long, double, boolean, "
                "timestamp, date, decimal(p,s), array<..>, map<..,..>, struct<name: type, ..>)"
            )
        parse_rest(self)

    def _decimal(self) -> None:
        if self.peek() != "(":
            return
        self.take("(")
        precision = self.number()
        scale = 0
        if self.peek() == ",":
            self.take(",")
            scale = self.number()
        self.take(")")
        if not 1 <= precision <= 38:
            raise ValueError(f"precision {precision}: Spark's decimals hold 1 to 38 digits")
        if scale > precision:
            raise ValueError(f"scale {scale} is above the precision {precision}")

    def _char(self) -> None:
        self.take("(")
        self.number()
        self.take(")")

    def _array(self) -> None:
        self.take("<")
        self.type()
        self.take(">")

    def _map(self) -> None:
        self.take("<")
        self.type()
        self.take(",")
        self.type()
        self.take(">")

    def _struct(self) -> None:
        self.take("<")
        if self.peek() == ">":
            self.take(">")
            return
        while True:
            self._struct_field()
            if self.peek() != ",":
                self.take(">")
                return
            self.take(",")

    def _struct_field(self) -> None:
        field_name = self.take()
        if not (field_name.startswith("`") or re.match(r"^[A-Za-z_]\w*$", field_name)):
            raise ValueError(f"struct field name '{field_name}' is not one Spark reads")
        if self.peek() == ":":
            self.take(":")
        if self.peek() in (",", ">", ""):
            raise ValueError(f"struct field '{field_name.strip('`')}' has no type")
        self.type()

    _COMPOSITES: ClassVar[dict[str, Callable[[_TypeParser], None]]] = {
        "decimal": _decimal,
        "dec": _decimal,
        "numeric": _decimal,
        "char": _char,
        "varchar": _char,
        "array": _array,
        "map": _map,
        "struct": _struct,
    }

    def number(self) -> int:
        token = self.take()
        if not token.isdigit():
            raise ValueError(f"a number expected, not '{token}'")
        return int(token)
