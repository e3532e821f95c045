"""Produce records that Python's Kafka clients cannot make: header keys that are not UTF-8.

A Kafka header key is bytes on the wire; Apache Kafka accepts any, and confluent-kafka's
Python producer only sends str keys (encoded as UTF-8). This helper calls the librdkafka that
ships inside the confluent-kafka wheel through ctypes (``rd_kafka_produceva``, whose header
name is a C string of any bytes but NUL), so a test can put on the broker what a producer in
another language could.
"""

from __future__ import annotations

import ctypes
import glob
import os

import confluent_kafka

_END, _TOPIC, _PARTITION, _VALUE, _KEY, _TIMESTAMP, _HEADER = 0, 1, 3, 4, 5, 8, 9
_MSG_F_COPY = 0x2


class _Mem(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t)]


class _Header(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("val", ctypes.c_void_p), ("size", ctypes.c_ssize_t)]


class _Value(ctypes.Union):
    _fields_ = [
        ("cstr", ctypes.c_char_p),
        ("i", ctypes.c_int),
        ("i32", ctypes.c_int32),
        ("i64", ctypes.c_int64),
        ("mem", _Mem),
        ("header", _Header),
        ("pad", ctypes.c_char * 64),
    ]


class _VU(ctypes.Structure):
    _fields_ = [("vtype", ctypes.c_int), ("u", _Value)]


def _library() -> ctypes.CDLL:
    folder = os.path.join(os.path.dirname(os.path.dirname(confluent_kafka.__file__)), "confluent_kafka.libs")
    lib = ctypes.CDLL(glob.glob(os.path.join(folder, "librdkafka*.so*"))[0])
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_produceva.restype = ctypes.c_void_p
    lib.rd_kafka_produceva.argtypes = [ctypes.c_void_p, ctypes.POINTER(_VU), ctypes.c_size_t]
    lib.rd_kafka_error_string.restype = ctypes.c_char_p
    lib.rd_kafka_error_string.argtypes = [ctypes.c_void_p]
    lib.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    return lib


def produce_raw(
    bootstrap: str, topic: str, partition: int, value: bytes, headers: list[tuple[bytes, bytes]], timestamp_ms: int | None = None
) -> None:
    """Produce one record whose header keys are the given bytes, verbatim."""
    lib = _library()
    conf = lib.rd_kafka_conf_new()
    error = ctypes.create_string_buffer(512)
    if lib.rd_kafka_conf_set(conf, b"bootstrap.servers", bootstrap.encode(), error, 512) != 0:
        raise RuntimeError(error.value.decode())
    producer = lib.rd_kafka_new(0, conf, error, 512)  # RD_KAFKA_PRODUCER
    if not producer:
        raise RuntimeError(error.value.decode())
    keep = [value, *[part for pair in headers for part in pair]]  # alive until flushed (copied anyway)
    items = [(_TOPIC, "cstr", topic.encode()), (_PARTITION, "i32", partition)]
    vus = (_VU * (4 + len(headers) + (1 if timestamp_ms is not None else 0)))()
    index = 0
    for vtype, field, data in items:
        vus[index].vtype = vtype
        setattr(vus[index].u, field, data)
        index += 1
    vus[index].vtype = _VALUE
    vus[index].u.mem = _Mem(ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p), len(value))
    index += 1
    for name, data in headers:
        vus[index].vtype = _HEADER
        vus[index].u.header = _Header(name, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p), len(data))
        index += 1
    if timestamp_ms is not None:
        vus[index].vtype = _TIMESTAMP
        vus[index].u.i64 = timestamp_ms
        index += 1
    vus[index].vtype = _END
    try:
        failure = lib.rd_kafka_produceva(producer, vus, index)
        if failure:
            raise RuntimeError(lib.rd_kafka_error_string(failure).decode())
        if lib.rd_kafka_flush(producer, 30_000) != 0:
            raise RuntimeError(f"record to {topic}[{partition}] not delivered within 30 s")
    finally:
        lib.rd_kafka_destroy(producer)
        del keep
