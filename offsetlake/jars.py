"""The JVM jars offsetlake uses, pinned in ``jars/jars.lock`` and resolved by ``make setup``.

Two sets, each on a classpath of its own:

- ``spark``: what every Spark session offsetlake makes adds to pyspark's own jars — Delta Lake for
  Spark (``delta-spark``), Spark's Kafka source and ``spark-avro`` with what they need
  (``jars/spark/pom.xml``);
- ``kafka``: Apache Kafka's broker and tools (``jars/kafka/pom.xml``), for the broker the tests,
  the demo and ``make airflow`` start.

``scripts/resolve_jars.py`` (run by ``make setup``) resolves both poms, checks every jar's SHA-256
against the lock and puts them in ``<repo>/.jars/<set>/`` (``$OFFSETLAKE_JARS`` names another
folder, e.g. in an image). At run time nothing is downloaded: a session is given these files
(``spark.jars``), never ``--packages``. The lock's line format is
``<set> <group>:<artifact>:<version> <sha256>``; the file name in the folder is
``<group>.<artifact>-<version>.jar``, so two groups' artifacts of one name cannot collide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from offsetlake.errors import JarsMissingError, OffsetlakeError

SETS = ("spark", "kafka")
REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "jars" / "jars.lock"


# Delta Lake for Spark in every session a JVM of offsetlake's starts, spark-submit jobs included
# (static settings: a Connect client cannot set them; its server, e.g. ``offsetlake spark-server``,
# was started with them)
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


@dataclass(frozen=True)
class LockedJar:
    """One line of ``jars/jars.lock``."""

    set: str
    group: str
    artifact: str
    version: str
    sha256: str

    @property
    def coordinates(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"

    @property
    def file_name(self) -> str:
        return f"{self.group}.{self.artifact}-{self.version}.jar"


def read_lock(path: Path = LOCK) -> list[LockedJar]:
    """Every pinned jar, in the lock's order; a malformed line is an error naming it."""
    jars = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        coordinates = parts[1].split(":") if len(parts) == 3 else []
        if len(coordinates) != 3 or parts[0] not in SETS or len(parts[2]) != 64:
            raise OffsetlakeError(f"{path}:{number}: expected '<set> <group>:<artifact>:<version> <sha256>', got {line!r}")
        group, artifact, version = coordinates
        jars.append(LockedJar(parts[0], group, artifact, version, parts[2]))
    return jars


def folder(jar_set: str) -> Path:
    """Where ``jar_set``'s jars are: ``$OFFSETLAKE_JARS/<set>``, else ``<repo>/.jars/<set>``."""
    return Path(os.environ.get("OFFSETLAKE_JARS") or REPO / ".jars") / jar_set


def paths(jar_set: str) -> list[Path]:
    """The resolved files of ``jar_set``, in the lock's order. Raises JarsMissingError naming the
    first missing file and what to run, so a session never starts without Delta or Kafka."""
    wanted = [jar for jar in read_lock() if jar.set == jar_set]
    where = folder(jar_set)
    found = [where / jar.file_name for jar in wanted]
    missing = [p for p in found if not p.is_file()]
    if missing or not wanted:
        what = missing[0].name if missing else f"any {jar_set} jar in {LOCK}"
        raise JarsMissingError(
            f"the pinned {jar_set} jars are not resolved ({what} missing in {where}): run `make setup`, "
            "which resolves jars/jars.lock into .jars/ (or set $OFFSETLAKE_JARS to a folder holding them)"
        )
    return found


def classpath(jar_set: str) -> str:
    """``jar_set``'s jars as a JVM classpath."""
    return os.pathsep.join(str(p) for p in paths(jar_set))


def spark_jars() -> str:
    """The ``spark``-set jars as ``spark.jars``/``--jars`` want them: comma-separated paths."""
    return ",".join(str(p) for p in paths("spark"))
