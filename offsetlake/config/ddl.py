"""Spark SQL data types as pipeline YAML writes them (``long``, ``decimal(10,2)``,
``array<struct<a: int>>``): a small parser of Spark's DDL type grammar, so a typo fails when the
pipeline loads, naming the field, before anything is planned or read."""

from __future__ import annotations

import re

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

    def type(self) -> None:  # noqa: C901 -- to be split (issue 36)
        name = self.take().lower()
        if name in _PRIMITIVE_TYPES:
            return
        if name in ("decimal", "dec", "numeric"):
            if self.peek() == "(":
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
            return
        if name in ("char", "varchar"):
            self.take("(")
            self.number()
            self.take(")")
            return
        if name == "array":
            self.take("<")
            self.type()
            self.take(">")
            return
        if name == "map":
            self.take("<")
            self.type()
            self.take(",")
            self.type()
            self.take(">")
            return
        if name == "struct":
            self.take("<")
            if self.peek() == ">":
                self.take(">")
                return
            while True:
                field_name = self.take()
                if not (field_name.startswith("`") or re.match(r"^[A-Za-z_]\w*$", field_name)):
                    raise ValueError(f"struct field name '{field_name}' is not one Spark reads")
                if self.peek() == ":":
                    self.take(":")
                if self.peek() in (",", ">", ""):
                    raise ValueError(f"struct field '{field_name.strip('`')}' has no type")
                self.type()
                if self.peek() == ",":
                    self.take(",")
                    continue
                self.take(">")
                return
        raise ValueError(
            f"unknown type '{name}' (Spark SQL types are e.g. string, long, double, boolean, "
            "timestamp, date, decimal(p,s), array<..>, map<..,..>, struct<name: type, ..>)"
        )

    def number(self) -> int:
        token = self.take()
        if not token.isdigit():
            raise ValueError(f"a number expected, not '{token}'")
        return int(token)
