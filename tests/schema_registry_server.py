"""A Confluent Schema Registry for the tests, in its own process: the REST API as confluent-kafka
2.16's ``SchemaRegistryClient`` and its Avro, Protobuf and JSON serdes use it. No registry server
ships on PyPI, and the client's ``mock://`` one never goes over HTTP, so it cannot fail, stall or
refuse a password. This one answers as Confluent's does: same paths, fields and error bodies
(40401 subject, 40402 version, 40403 schema not found, 42201 invalid schema, 42202 invalid
version, 409 incompatible, 40408 no subject-level config), one id per schema across subjects.

Checked: AVRO is parsed with fastavro (references resolved from the registry) and compared with
Avro's resolution rules as Java's ``SchemaCompatibility`` applies them: a reader field missing in
the writer needs a default; types change only by promotion (int->long/float/double,
long->float/double, float->double, string<->bytes); each writer union branch must be readable;
writer enum symbols missing in the reader need a reader default; fixed keeps name and size;
arrays, maps, nested and recursive records and named types are followed (logical types count as
their base type). PROTOBUF as a base64 ``FileDescriptorProto`` (what ``ProtobufSerializer``
sends) must decode, and a removed message or a field number whose wire kind or message/enum type
changes is incompatible (no oneof, reserved or syntax rules); ``.proto`` text gets a shape check
only (no protoc here) and is never compared. JSON must be a valid JSON Schema for its draft
(``jsonschema``); two JSON schemas are never incompatible. A schema type change always is.

Not done: ``normalize``, ``format`` and ``reference_format`` are ignored (schemas come back as
stored: no text<->descriptor conversion for Protobuf), as is ``subject`` on ``/schemas/ids/{id}``
(one context); metadata and rule sets are stored and returned, not enforced; no ``/mode``, no
guid, metadata or referencedby lookups, no ``DELETE /config``. ``/associations`` answers an empty
list, so the serializers' default subject strategy falls back to the topic name as with Confluent.

A process of its own because some deltalake calls hold the GIL in the test process. Faults go
through ``/_harness/``, a path the client never uses: ``POST /_harness/faults`` with
``{"status": 503, "delay_s": 0, "count": null}``; ``GET /_harness/stats`` counts API requests per
endpoint pattern (``DELETE`` resets). Run: ``python tests/schema_registry_server.py --port 0
--ready-file PATH [--user U --password P] [--state-file F]``, or use ``LocalSchemaRegistry``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import fastavro
import jsonschema
from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError

Params = dict[str, str]
Query = dict[str, list[str]]
LEVELS = ("NONE", "BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL", "FULL_TRANSITIVE")
TYPES = ("AVRO", "PROTOBUF", "JSON")
_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
_COMPLEX = {"record", "error", "enum", "fixed", "array", "map"}
_PROMOTIONS = {
    ("int", "long"),
    ("int", "float"),
    ("int", "double"),
    ("long", "float"),
    ("long", "double"),
    ("float", "double"),
    ("string", "bytes"),
    ("bytes", "string"),
}
# FieldDescriptorProto types by how they look on the wire: a change within a group still reads.
_PROTO_KINDS = {
    3: "varint",
    4: "varint",
    5: "varint",
    8: "varint",
    13: "varint",
    17: "zigzag",
    18: "zigzag",
    7: "fixed32",
    15: "fixed32",
    6: "fixed64",
    16: "fixed64",
    9: "bytes",
    12: "bytes",
    1: "double",
    2: "float",
    10: "group",
    11: "message",
    14: "enum",
}


class ApiError(Exception):
    """An error answer: HTTP ``status`` with the registry's ``{"error_code", "message"}`` body."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _err(kind: str, description: str, info: str) -> str:
    """One compatibility message, in the shape of Confluent's verbose answers."""
    return f"{{errorType:'{kind}', description:'{description}', additionalInfo:'{info}'}}"


def _resolve(schema: Any, named: dict[str, Any]) -> Any:
    """The schema behind a type name or a ``{"type": ...}`` wrapper; a primitive as its name."""
    for _ in range(64):
        if isinstance(schema, str) and schema in named:
            schema = named[schema]
        elif isinstance(schema, dict) and schema.get("type") not in _COMPLEX:
            schema = schema.get("type")
        else:
            break
    return schema


def _kind(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    return schema if isinstance(schema, str) else "record" if schema["type"] == "error" else schema["type"]


class _AvroCheck:
    """Can data written with one Avro schema be read with another (the spec's resolution rules)?
    ``errors`` says why not; ``active`` holds the record pairs under check, so recursion ends."""

    def __init__(self, writer_named: dict[str, Any], reader_named: dict[str, Any]) -> None:
        self.wn, self.rn = writer_named, reader_named
        self.active: set[tuple[str, str]] = set()
        self.errors: list[str] = []

    def check(self, writer: Any, reader: Any, path: str) -> None:
        w, r = _resolve(writer, self.wn), _resolve(reader, self.rn)
        wk, rk, where = _kind(w), _kind(r), path or "/"
        if wk == "union":
            for i, branch in enumerate(w):
                self.check(branch, r, f"{path}/{i}")
        elif rk == "union":
            if not any(self._fits(w, branch) for branch in r):
                self.errors.append(_err("MISSING_UNION_BRANCH", f"The reader union at path '{where}' has no branch for {wk}", wk))
        elif wk != rk:
            if (wk, rk) not in _PROMOTIONS:
                self.errors.append(
                    _err(
                        "TYPE_MISMATCH",
                        f"The type at path '{where}' in the reader schema does not match the writer schema",
                        f"reader type: {rk} not compatible with writer type: {wk}",
                    )
                )
        elif wk in ("array", "map"):
            part = "items" if wk == "array" else "values"
            self.check(w[part], r[part], f"{path}/{part}")
        elif wk in ("record", "enum", "fixed"):
            self._named(w, r, wk, path)

    def _fits(self, writer: Any, reader: Any) -> bool:
        saved, self.errors = (self.errors, set(self.active)), []
        try:
            self.check(writer, reader, "")
            return not self.errors
        finally:
            self.errors, self.active = saved

    def _named(self, w: dict[str, Any], r: dict[str, Any], kind: str, path: str) -> None:
        if w["name"].rsplit(".", 1)[-1] not in {n.rsplit(".", 1)[-1] for n in (r["name"], *r.get("aliases", []))}:
            self.errors.append(_err("NAME_MISMATCH", f"The type name at path '{path or '/'}' differs", f"expected: {w['name']}"))
        elif kind == "fixed" and w["size"] != r["size"]:
            self.errors.append(
                _err(
                    "FIXED_SIZE_MISMATCH",
                    f"The size of the fixed at path '{path or '/'}' differs",
                    f"expected: {w['size']}, found: {r['size']}",
                )
            )
        elif kind == "enum":
            missing = [s for s in w["symbols"] if s not in r["symbols"]]
            if missing and "default" not in r:
                self.errors.append(
                    _err("MISSING_ENUM_SYMBOLS", f"The reader enum at path '{path}/symbols' lacks writer symbols {missing}", str(missing))
                )
        elif kind == "record" and (w["name"], r["name"]) not in self.active:
            self.active.add((w["name"], r["name"]))
            by_name = {f["name"]: f for f in w["fields"]}
            for i, field in enumerate(r["fields"]):
                written = next((by_name[n] for n in (field["name"], *field.get("aliases", [])) if n in by_name), None)
                if written is not None:
                    self.check(written["type"], field["type"], f"{path}/fields/{i}/type")
                elif "default" not in field:
                    self.errors.append(
                        _err(
                            "READER_FIELD_MISSING_DEFAULT_VALUE",
                            f"The field '{field['name']}' at path "
                            f"'{path}/fields/{i}' in the reader schema has no default value and is missing in "
                            "the writer schema",
                            field["name"],
                        )
                    )


def _records_have_fields(doc: Any) -> None:
    """What fastavro lets through and Avro's parser does not: a record without a field list."""
    if isinstance(doc, dict) and doc.get("type") in ("record", "error") and not isinstance(doc.get("fields"), list):
        raise ValueError(f"Record has no fields: {json.dumps(doc)}")
    for part in doc if isinstance(doc, list) else doc.values() if isinstance(doc, dict) else ():
        _records_have_fields(part)


def _proto_descriptor(text: str) -> descriptor_pb2.FileDescriptorProto | None:
    """The descriptor a base64 schema holds; None for ``.proto`` text (checked for shape only)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        if not re.search(r"\b(message|enum|syntax)\b", text) or text.count("{") != text.count("}"):
            raise ValueError("neither .proto text nor a base64 FileDescriptorProto") from None
        return None
    descriptor = descriptor_pb2.FileDescriptorProto()
    try:
        descriptor.ParseFromString(raw)
    except DecodeError as e:
        raise ValueError(f"not a FileDescriptorProto: {e}") from None
    return descriptor


def _proto_fields(fd: descriptor_pb2.FileDescriptorProto) -> dict[str, dict[int, tuple[str, str]]]:
    """Every message of a file, nested ones too, by full name: field number -> (wire kind, type name)."""
    out: dict[str, dict[int, tuple[str, str]]] = {}
    todo = [(fd.package, m) for m in fd.message_type]
    while todo:
        prefix, m = todo.pop()
        name = f"{prefix}.{m.name}" if prefix else m.name
        out[name] = {f.number: (_PROTO_KINDS.get(f.type, str(f.type)), f.type_name.lstrip(".")) for f in m.field}
        todo += [(name, n) for n in m.nested_type]
    return out


def _proto_errors(writer: descriptor_pb2.FileDescriptorProto, reader: descriptor_pb2.FileDescriptorProto) -> list[str]:
    w, r = _proto_fields(writer), _proto_fields(reader)
    errors = [_err("MESSAGE_REMOVED", f"The message {name} was removed", name) for name in w if name not in r]
    return errors + [
        _err("FIELD_KIND_CHANGED", f"Field {n} of {name} changed from {kind} to {r[name][n]}", f"{name}.{n}")
        for name, fields in w.items()
        if name in r
        for n, kind in fields.items()
        if r[name].get(n, kind) != kind
    ]


def _key(schema: dict[str, Any]) -> str:
    """What makes two registrations one schema: type, text (JSON with sorted keys, if JSON),
    references, metadata and rule set."""
    text = schema["schema"]
    if schema["schemaType"] != "PROTOBUF":
        try:
            text = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
        except ValueError:
            pass
    parts = [schema["schemaType"], text.strip(), schema.get("references", []), schema.get("metadata"), schema.get("ruleSet")]
    return json.dumps(parts, sort_keys=True)


def _flag(q: Query, name: str) -> bool:
    return q.get(name, ["false"])[0].lower() == "true"  # the client sends both True and true


def _page(items: list[Any], q: Query) -> list[Any]:
    offset, limit = int(q.get("offset", ["0"])[0]), int(q.get("limit", ["-1"])[0])
    return items[offset:] if limit < 0 else items[offset : offset + limit]


class RawBody(str):
    """An answer sent as it is (a schema's own text), not as a JSON string."""


class Registry:
    """The registry's state and answers, one request at a time (``Server`` holds ``lock`` around
    each). Saved to ``state_file`` after every change, so a restart keeps ids as Kafka keeps them."""

    def __init__(self, state_file: Path | None) -> None:
        self.lock = threading.Lock()
        self.state_file = state_file
        self.schemas: dict[int, dict[str, Any]] = {}  # id -> schemaType, schema, references, guid[, metadata, ruleSet]
        self.subjects: dict[str, list[dict[str, Any]]] = {}  # subject -> [{version, id, deleted}]
        self.config: dict[str, dict[str, Any]] = {"": {"compatibilityLevel": "BACKWARD"}}  # "": the global one
        if state_file is not None and state_file.exists():
            state = json.loads(state_file.read_text())
            self.schemas = {int(i): s for i, s in state["schemas"].items()}
            self.subjects, self.config = state["subjects"], state["config"]
        self.ids = {_key(s): i for i, s in self.schemas.items()}

    def _save(self) -> None:
        if self.state_file is not None:
            tmp = self.state_file.with_name(self.state_file.name + ".tmp")
            tmp.write_text(json.dumps({"schemas": self.schemas, "subjects": self.subjects, "config": self.config}))
            os.replace(tmp, self.state_file)

    def _versions(self, subject: str, deleted: bool) -> list[dict[str, Any]]:
        found = [v for v in self.subjects.get(subject, []) if deleted or not v["deleted"]]
        if not found:
            raise ApiError(404, 40401, f"Subject '{subject}' not found.")
        return found

    def _version(self, subject: str, version: str, deleted: bool = False) -> dict[str, Any]:
        found = self._versions(subject, deleted)
        if version in ("latest", "-1"):
            return found[-1]
        n = int(version) if re.fullmatch(r"\d{1,10}", version) else 0
        if not 1 <= n < 2**31:
            raise ApiError(
                422,
                42202,
                f"The specified version '{version}' is not a valid version id. Allowed values are "
                'between [1, 2^31-1] and the string "latest"',
            )
        for v in found:
            if v["version"] == n:
                return v
        raise ApiError(404, 40402, f"Version {n} not found.")

    def _schema(self, schema_id: str) -> tuple[int, dict[str, Any]]:
        sid = int(schema_id) if schema_id.isdigit() else -1
        if sid not in self.schemas or not self._holders(sid, True):  # soft-deleted ones still answer
            raise ApiError(404, 40403, f"Schema {schema_id} not found")
        return sid, self.schemas[sid]

    def _holders(self, sid: int, deleted: bool) -> list[dict[str, Any]]:
        return [
            {"subject": s, "version": v["version"]}
            for s, vs in sorted(self.subjects.items())
            for v in vs
            if v["id"] == sid and (deleted or not v["deleted"])
        ]

    @staticmethod
    def _body(schema: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"schema": schema["schema"], "guid": schema["guid"]}
        if schema["schemaType"] != "AVRO":  # a real registry leaves the default type out
            body["schemaType"] = schema["schemaType"]
        return body | {name: schema[name] for name in ("references", "metadata", "ruleSet") if schema.get(name)}

    def _version_body(self, subject: str, v: dict[str, Any]) -> dict[str, Any]:
        return {"subject": subject, "version": v["version"], "id": v["id"], **self._body(self.schemas[v["id"]])}

    def _level(self, subject: str) -> str:
        return self.config.get(subject, {}).get("compatibilityLevel") or self.config[""]["compatibilityLevel"]

    def _candidate(self, body: Any) -> dict[str, Any]:
        """The schema a request carries, checked as its type is (see the module docstring)."""
        if not isinstance(body, dict) or not isinstance(body.get("schema"), str) or not body["schema"].strip():
            raise ApiError(422, 42201, "Empty schema")
        kind = body.get("schemaType") or "AVRO"
        if kind not in TYPES:
            raise ApiError(422, 42201, f"Invalid schema type {kind}")
        try:
            refs = [
                {"name": str(r["name"]), "subject": str(r["subject"]), "version": int(r["version"])} for r in body.get("references") or []
            ]
        except (KeyError, TypeError, ValueError):
            raise ApiError(422, 42201, f"Invalid references {body.get('references')}") from None
        schema = {"schemaType": kind, "schema": body["schema"], "references": refs}
        schema |= {k: body[k] for k in ("metadata", "ruleSet") if body.get(k)}
        try:
            for ref in refs:
                self._ref(ref)
            if kind == "AVRO":
                self._avro(schema)
            elif kind == "JSON":
                doc = json.loads(schema["schema"])
                if not isinstance(doc, dict | bool):
                    raise ValueError("a JSON schema is an object or a boolean")
                jsonschema.validators.validator_for(doc).check_schema(doc)
            else:
                _proto_descriptor(schema["schema"])
        except (ValueError, TypeError, KeyError, jsonschema.SchemaError, fastavro.schema.SchemaParseException) as e:
            raise ApiError(422, 42201, f"Invalid schema {schema['schema']}, details: {getattr(e, 'message', None) or e}") from None
        return schema

    def _ref(self, ref: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.schemas[self._version(ref["subject"], str(ref["version"]), deleted=True)["id"]]
        except ApiError:
            raise ValueError(f"reference {ref['name']} -> {ref['subject']} version {ref['version']} not found") from None

    def _avro(self, schema: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The parsed schema and every named type it can use, its references' types included."""
        named: dict[str, Any] = {}
        seen: set[str] = set()

        def load(s: dict[str, Any]) -> Any:
            for target in (self._ref(ref) for ref in s.get("references", [])):
                if _key(target) not in seen:
                    seen.add(_key(target))
                    load(target)
            doc = json.loads(s["schema"])
            _records_have_fields(doc)
            return fastavro.parse_schema(doc, named)

        return load(schema), named

    def _readable(self, writer: dict[str, Any], reader: dict[str, Any]) -> list[str]:
        if writer["schemaType"] == "AVRO":
            (w, wn), (r, rn) = self._avro(writer), self._avro(reader)
            check = _AvroCheck(wn, rn)
            check.check(w, r, "")
            return check.errors
        if writer["schemaType"] == "PROTOBUF":
            w, r = _proto_descriptor(writer["schema"]), _proto_descriptor(reader["schema"])
            return _proto_errors(w, r) if w is not None and r is not None else []
        return []

    def _compat(self, old: dict[str, Any], old_version: int, new: dict[str, Any], level: str, verbose: bool = True) -> list[str]:
        """Why ``new`` may not follow ``old`` under ``level``: BACKWARD, new reads old's data;
        FORWARD, old reads new's; FULL, both."""
        if level == "NONE":
            return []
        if old["schemaType"] != new["schemaType"]:
            errors = [_err("TYPE_MISMATCH", "Incompatible because of different schema type", new["schemaType"])]
        else:
            errors = self._readable(old, new) if level.startswith(("BACKWARD", "FULL")) else []
            errors += self._readable(new, old) if level.startswith(("FORWARD", "FULL")) else []
        if errors and verbose:
            errors += [f"{{oldSchemaVersion: {old_version}}}", f"{{oldSchema: '{old['schema']}'}}", f"{{compatibility: '{level}'}}"]
        return errors

    def _compat_all(self, subject: str, new: dict[str, Any]) -> list[str]:
        level = self._level(subject)
        live = [v for v in self.subjects.get(subject, []) if not v["deleted"]]
        against = live if level.endswith("TRANSITIVE") else live[-1:]
        return [e for v in reversed(against) for e in self._compat(self.schemas[v["id"]], v["version"], new, level)]

    # --- endpoints: (path parameters, query, JSON body) -> JSON answer --------------------------

    def register(self, p: Params, q: Query, body: Any) -> Any:
        subject, schema = p["subject"], self._candidate(body)
        key = _key(schema)
        for v in self.subjects.get(subject, []):
            if not v["deleted"] and _key(self.schemas[v["id"]]) == key:
                return {"id": v["id"], "guid": self.schemas[v["id"]]["guid"], "version": v["version"], "subject": subject}
        errors = self._compat_all(subject, schema)
        if errors:
            raise ApiError(
                409,
                409,
                f'Schema being registered is incompatible with an earlier schema for subject "{subject}", details: [{", ".join(errors)}]',
            )
        sid = self.ids.get(key)
        if sid is None:  # a schema known under another subject keeps its id
            sid = max(self.schemas, default=0) + 1
            self.schemas[sid], self.ids[key] = {**schema, "guid": str(uuid.uuid4())}, sid
        version = max((v["version"] for v in self.subjects.get(subject, [])), default=0) + 1
        self.subjects.setdefault(subject, []).append({"version": version, "id": sid, "deleted": False})
        self._save()
        return {"id": sid, "guid": self.schemas[sid]["guid"], "version": version, "subject": subject}

    def lookup(self, p: Params, q: Query, body: Any) -> Any:
        key = _key(self._candidate(body))
        for v in reversed(self._versions(p["subject"], _flag(q, "deleted"))):
            if _key(self.schemas[v["id"]]) == key:
                return self._version_body(p["subject"], v)
        raise ApiError(404, 40403, "Schema not found")

    def subjects_list(self, p: Params, q: Query, body: Any) -> Any:
        prefix, deleted, only = q.get("subjectPrefix", [""])[0], _flag(q, "deleted"), _flag(q, "deleted_only")
        return _page(
            [
                s
                for s, vs in sorted(self.subjects.items())
                if s.startswith(prefix) and vs and (all(v["deleted"] for v in vs) if only else deleted or any(not v["deleted"] for v in vs))
            ],
            q,
        )

    def versions(self, p: Params, q: Query, body: Any) -> Any:
        only = _flag(q, "deleted_only")
        found = self._versions(p["subject"], _flag(q, "deleted") or only)
        return _page([v["version"] for v in found if v["deleted"] or not only], q)

    def version(self, p: Params, q: Query, body: Any) -> Any:
        return self._version_body(p["subject"], self._version(p["subject"], p["version"], _flag(q, "deleted")))

    def version_schema(self, p: Params, q: Query, body: Any) -> Any:
        return RawBody(self.schemas[self._version(p["subject"], p["version"], _flag(q, "deleted"))["id"]]["schema"])

    def delete_subject(self, p: Params, q: Query, body: Any) -> Any:
        subject = p["subject"]
        vs = self._versions(subject, True)
        if _flag(q, "permanent"):
            if any(not v["deleted"] for v in vs):
                raise ApiError(404, 40405, f"Subject '{subject}' was not deleted first before being permanently deleted")
            del self.subjects[subject]
            self.config.pop(subject, None)
        else:
            vs = [v for v in vs if not v["deleted"]]
            if not vs:
                raise ApiError(404, 40404, f"Subject '{subject}' was soft deleted.Set permanent=true to delete permanently")
            for v in vs:
                v["deleted"] = True
        self._save()
        return [v["version"] for v in vs]

    def delete_version(self, p: Params, q: Query, body: Any) -> Any:
        subject, permanent = p["subject"], _flag(q, "permanent")
        v = self._version(subject, p["version"], deleted=permanent)
        if permanent and not v["deleted"]:
            raise ApiError(404, 40407, f"Subject '{subject}' Version {v['version']} was not deleted first before being permanently deleted")
        if permanent:
            self.subjects[subject].remove(v)
        else:
            v["deleted"] = True
        self._save()
        return v["version"]

    def schema_by_id(self, p: Params, q: Query, body: Any) -> Any:
        return self._body(self._schema(p["id"])[1])

    def schema_versions(self, p: Params, q: Query, body: Any) -> Any:
        subject = q.get("subject", [None])[0]
        holders = self._holders(self._schema(p["id"])[0], _flag(q, "deleted"))
        return _page([h for h in holders if subject in (None, h["subject"])], q)

    def schema_subjects(self, p: Params, q: Query, body: Any) -> Any:
        return sorted({h["subject"] for h in self.schema_versions(p, q, body)})

    def get_config(self, p: Params, q: Query, body: Any) -> Any:
        subject = p.get("subject", "")
        if subject not in self.config and not _flag(q, "defaultToGlobal"):
            raise ApiError(404, 40408, f"Subject '{subject}' does not have subject-level compatibility configured")
        return self.config.get(subject, self.config[""])

    def put_config(self, p: Params, q: Query, body: Any) -> Any:
        level = str(body.get("compatibility") or body.get("compatibilityLevel") or "").upper() if isinstance(body, dict) else "?"
        if level not in (*LEVELS, ""):
            raise ApiError(
                422,
                42203,
                "Invalid compatibility level. Valid values are none, backward, forward, full, "
                "backward_transitive, forward_transitive, and full_transitive",
            )
        old = self.config.get(p.get("subject", ""), {})
        new = {k: v for k, v in body.items() if k not in ("compatibility", "compatibilityLevel")}
        self.config[p.get("subject", "")] = old | new | ({"compatibilityLevel": level} if level else {})
        self._save()
        return body | ({"compatibility": level} if level else {})

    def check_version(self, p: Params, q: Query, body: Any) -> Any:
        schema, verbose = self._candidate(body), _flag(q, "verbose")
        v = self._version(p["subject"], p["version"])
        errors = self._compat(self.schemas[v["id"]], v["version"], schema, self._level(p["subject"]), verbose)
        return {"is_compatible": not errors} | ({"messages": errors} if verbose else {})

    def check_all(self, p: Params, q: Query, body: Any) -> Any:
        schema = self._candidate(body)
        errors = self._compat_all(p["subject"], schema)
        return {"is_compatible": not errors} | ({"messages": errors} if _flag(q, "verbose") else {})


_ROUTES = [
    ("GET", "/", lambda r, p, q, b: {}),
    ("GET", "/schemas/types", lambda r, p, q, b: list(TYPES)),
    ("GET", "/associations/resources/{namespace}/{name}", lambda r, p, q, b: []),
    ("GET", "/schemas/ids/{id}", Registry.schema_by_id),
    ("GET", "/schemas/ids/{id}/versions", Registry.schema_versions),
    ("GET", "/schemas/ids/{id}/subjects", Registry.schema_subjects),
    ("GET", "/subjects", Registry.subjects_list),
    ("POST", "/subjects/{subject}", Registry.lookup),
    ("DELETE", "/subjects/{subject}", Registry.delete_subject),
    ("GET", "/subjects/{subject}/versions", Registry.versions),
    ("POST", "/subjects/{subject}/versions", Registry.register),
    ("GET", "/subjects/{subject}/versions/{version}", Registry.version),
    ("DELETE", "/subjects/{subject}/versions/{version}", Registry.delete_version),
    ("GET", "/subjects/{subject}/versions/{version}/schema", Registry.version_schema),
    ("GET", "/config", Registry.get_config),
    ("PUT", "/config", Registry.put_config),
    ("GET", "/config/{subject}", Registry.get_config),
    ("PUT", "/config/{subject}", Registry.put_config),
    ("POST", "/compatibility/subjects/{subject}/versions/{version}", Registry.check_version),
    ("POST", "/compatibility/subjects/{subject}/versions", Registry.check_all),
]
_COMPILED = [(m, t, re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(t)) + "$"), f) for m, t, f in _ROUTES]


class Server(ThreadingHTTPServer):
    """The HTTP side: request counts, the harness's faults, basic auth, then the registry."""

    daemon_threads = True

    def __init__(self, port: int, registry: Registry, user: str | None, password: str | None) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.registry = registry
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode() if user is not None else None
        self.lock = threading.Lock()
        self.fault: dict[str, Any] | None = None
        self.counts: dict[str, int] = {}
        self.faults_served = 0

    def answer(self, method: str, target: str, auth: str | None, raw: bytes) -> Any:
        parts = urlsplit(target)
        path, q = parts.path.rstrip("/") or "/", parse_qs(parts.query, keep_blank_values=True)
        if path.startswith("/_harness/"):
            self._authorize(auth)
            return self._admin(method, path, raw)
        route = next(((t, f, match) for m, t, rx, f in _COMPILED if m == method and (match := rx.match(path))), None)
        with self.lock:
            name = f"{method} {route[0] if route else '(unknown)'}"
            self.counts[name] = self.counts.get(name, 0) + 1
            fault = self.fault
            if fault is not None:
                self.faults_served += 1
                if fault["count"] is not None:
                    fault["count"] -= 1
                    self.fault = fault if fault["count"] > 0 else None
        if fault is not None:
            time.sleep(fault["delay_s"])
            if fault["status"] is not None:
                raise ApiError(fault["status"], fault["status"], f"Injected fault: HTTP {fault['status']}")
        self._authorize(auth)
        if route is None:
            raise ApiError(404, 404, "HTTP 404 Not Found")
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            raise ApiError(400, 400, "The request body is not JSON") from None
        with self.registry.lock:
            return route[1](self.registry, {k: unquote(v) for k, v in route[2].groupdict().items()}, q, body)

    def _authorize(self, auth: str | None) -> None:
        if self.expected is not None and not hmac.compare_digest((auth or "").encode(), self.expected.encode()):
            raise ApiError(401, 401, "Unauthorized")

    def _admin(self, method: str, path: str, raw: bytes) -> Any:
        with self.lock:
            if path == "/_harness/faults" and method == "POST":
                spec = json.loads(raw or b"{}")
                status, delay = spec.get("status"), float(spec.get("delay_s") or 0)
                self.fault = None if status is None and not delay else {"status": status, "delay_s": delay, "count": spec.get("count")}
            if path == "/_harness/faults":
                return {"fault": self.fault}
            if path == "/_harness/stats" and method == "DELETE":
                self.counts, self.faults_served = {}, 0
            return {"requests": dict(self.counts), "faults_served": self.faults_served}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects of a registry
    server: Server

    def _handle(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = 200
        try:
            body = self.server.answer(self.command, self.path, self.headers.get("Authorization"), raw)
        except ApiError as e:
            status, body = e.status, {"error_code": e.code, "message": e.message}
        except Exception as e:  # a bug here must still answer, as a registry's 500 does
            status, body = 500, {"error_code": 50001, "message": f"{type(e).__name__}: {e}"}
        data = (body if isinstance(body, RawBody) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Basic realm="SchemaRegistry"')
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _handle


class LocalSchemaRegistry:
    """The registry in its own process for a test or a session: started on a free port (its old
    one on ``restart``), stopped through its process group's id, never by name."""

    def __init__(self, log_path: Path, user: str | None = None, password: str | None = None, state_file: Path | None = None) -> None:
        self.log_path = Path(log_path)
        self.user, self.password = user, password
        self.state_file = Path(state_file) if state_file is not None else None
        self.ready_file = self.log_path.with_name(self.log_path.name + ".ready")
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the schema registry has not been started")
        return f"http://127.0.0.1:{self.port}"

    def client_config(self) -> dict[str, str]:
        """The ``SchemaRegistryClient`` configuration for this registry."""
        auth = {"basic.auth.user.info": f"{self.user}:{self.password}"} if self.user is not None else {}
        return {"url": self.url, **auth}

    def start(self, timeout_s: float = 30) -> LocalSchemaRegistry:
        self.ready_file.unlink(missing_ok=True)
        command = [sys.executable, __file__, "--port", str(self.port), "--ready-file", str(self.ready_file)]
        command += ["--user", self.user, "--password", self.password or ""] if self.user is not None else []
        command += ["--state-file", str(self.state_file)] if self.state_file is not None else []
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"the schema registry exited with {self.process.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the schema registry did not start; see {self.log_path}")
            time.sleep(0.05)
        self.port = urlsplit(self.ready_file.read_text().strip()).port or 0
        return self

    def _admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"}, method=method)
        if self.user is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode())
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    def fail(self, status: int | None, delay_s: float = 0, count: int | None = None) -> None:
        """Answer the next ``count`` API requests (all, if None) with ``status`` after ``delay_s``
        seconds; ``status=None`` with a delay only slows them; ``fail(None)`` clears."""
        self._admin("POST", "/_harness/faults", {"status": status, "delay_s": delay_s, "count": count})

    def stats(self) -> dict[str, Any]:
        """``{"requests": {"GET /schemas/ids/{id}": n, ...}, "faults_served": n}`` since the start
        or ``reset_stats``; requests refused by a fault or for want of a password count too."""
        return self._admin("GET", "/_harness/stats")

    def reset_stats(self) -> None:
        self._admin("DELETE", "/_harness/stats")

    def stop(self, timeout_s: float = 10) -> None:
        from offsetlake.embedded.local_broker import stop_process_group

        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            stop_process_group(process, signal.SIGTERM, timeout_s)

    def restart(self, timeout_s: float = 30) -> LocalSchemaRegistry:
        """Stop, then start on the same port with the same state file (without one: empty)."""
        self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> LocalSchemaRegistry:
        return self if self.process is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A Confluent Schema Registry for the tests.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--user")
    parser.add_argument("--password")
    parser.add_argument("--state-file", type=Path)
    args = parser.parse_args(argv)
    server = Server(args.port, Registry(args.state_file), args.user, args.password)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
    tmp.write_text(url)
    os.replace(tmp, args.ready_file)  # whole or absent: the handle reads it as soon as it exists
    print(f"schema registry listening on {url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
