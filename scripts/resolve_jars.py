#!/usr/bin/env python3
"""Resolve the pinned JVM jars (jars/<set>/pom.xml) into .jars/<set>/, checked against jars/jars.lock.

    scripts/resolve_jars.py            # make setup: resolve what is missing, verify every SHA-256
    scripts/resolve_jars.py --lock     # re-resolve the poms and rewrite jars/jars.lock (after a pom change)
    scripts/resolve_jars.py --offline  # only check .jars/ against the lock (an image build); never resolves

Idempotent: a set whose folder already holds exactly the locked files with their checksums is left
alone and nothing is downloaded. Otherwise Maven (with strict repository checksums) resolves the
set's pom into its local repository, the resolved coordinates must equal the lock's, every file's
SHA-256 must equal the lock's, and only then does the folder get replaced (atomically, by rename).
The ``spark`` set leaves out every artifact pyspark's own jars folder already ships (any version).
Exit 0 when every set is in place; 2 with a message naming the set, jar and what differs.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offsetlake.jars import LOCK, REPO, SETS, LockedJar, folder, read_lock

DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
# group:artifact:type[:classifier]:version:scope:path[ -- module ...]
LISTED = re.compile(r"^\s+([^:\s]+):([^:\s]+):jar:(?:[^:\s]+:)?([^:\s]+):(?:compile|runtime):(\S+?\.jar)")


class ResolveError(Exception):
    pass


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pyspark_artifacts() -> set[str]:
    """Artifact ids of the jars pyspark ships (``scala-library-2.13.18.jar`` -> ``scala-library``)."""
    import pyspark

    shipped = Path(pyspark.__file__).parent / "jars"
    return {m.group(1) for p in shipped.glob("*.jar") if (m := re.match(r"^(.+?)-\d[^-]*(?:-[^-]+)?\.jar$", p.name))}


def maven_resolve(jar_set: str) -> list[tuple[LockedJar, Path]]:
    """The set's runtime jars as Maven resolves its pom (downloading what is missing), each with
    its file in Maven's local repository; the spark set without what pyspark ships."""
    pom = REPO / "jars" / jar_set / "pom.xml"
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as listing:
        command = ["mvn", "-B", "-q", "-C", "-f", str(pom), f"{DEPENDENCY_PLUGIN}:list"]
        command += [f"-DoutputFile={listing.name}", "-DoutputAbsoluteArtifactFilename=true", "-DincludeScope=runtime"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise ResolveError(f"Maven could not resolve {pom}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
        lines = Path(listing.name).read_text().splitlines()
    skip = pyspark_artifacts() if jar_set == "spark" else set()
    resolved = []
    for line in lines:
        found = LISTED.match(line)
        if found and found.group(2) not in skip:
            group, artifact, version, path = found.groups()
            resolved.append((LockedJar(jar_set, group, artifact, version, sha256(Path(path))), Path(path)))
    if not resolved:
        raise ResolveError(f"Maven listed no jars for {pom}")
    return resolved


def problem(jar_set: str, locked: list[LockedJar]) -> str | None:
    """What keeps the set's folder from holding exactly the locked files with their checksums, or None."""
    where = folder(jar_set)
    if not where.is_dir():
        return f"{where} does not exist"
    names = {p.name for p in where.glob("*.jar")}
    wanted = {jar.file_name for jar in locked}
    if names - wanted or wanted - names:
        return f"{where}: missing {sorted(wanted - names)[:3]}, not locked {sorted(names - wanted)[:3]}"
    for jar in locked:
        found = sha256(where / jar.file_name)
        if found != jar.sha256:
            return f"{where / jar.file_name}: SHA-256 {found} is not the locked {jar.sha256} ({jar.coordinates})"
    return None


def compare(jar_set: str, locked: list[LockedJar], resolved: list[LockedJar]) -> None:
    """Raise naming every difference between what Maven resolved and what the lock pins."""
    pinned = {(j.group, j.artifact): j for j in locked}
    got = {(j.group, j.artifact): j for j in resolved}
    problems = [f"{pinned[k].coordinates} is locked but not resolved" for k in sorted(pinned.keys() - got.keys())]
    problems += [f"{got[k].coordinates} is resolved but not locked" for k in sorted(got.keys() - pinned.keys())]
    for key in sorted(pinned.keys() & got.keys()):
        want, have = pinned[key], got[key]
        if want.version != have.version:
            problems.append(f"{want.coordinates} is locked, Maven resolved version {have.version}")
        elif want.sha256 != have.sha256:
            problems.append(f"{want.coordinates}: SHA-256 {have.sha256} differs from the locked {want.sha256}")
    if problems:
        raise ResolveError(
            f"the {jar_set} jars differ from {LOCK.relative_to(REPO)} (after a pom change run `scripts/resolve_jars.py --lock`):\n  "
            + "\n  ".join(problems)
        )


def install(jar_set: str, resolved: list[tuple[LockedJar, Path]]) -> None:
    """Copy the verified files into a new folder beside the set's, then swap it in by rename."""
    where = folder(jar_set)
    where.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=f".{jar_set}-", dir=where.parent))
    fresh.chmod(0o755)  # mkdtemp's 0700 would keep other users (an image's service user) out
    for jar, path in resolved:
        shutil.copyfile(path, fresh / jar.file_name)
    old = where.with_name(f".{jar_set}-old")
    shutil.rmtree(old, ignore_errors=True)
    if where.exists():
        where.rename(old)
    fresh.rename(where)
    shutil.rmtree(old, ignore_errors=True)


def write_lock(resolved: dict[str, list[LockedJar]]) -> None:
    lines = [
        "# The JVM jars offsetlake runs with: <set> <group>:<artifact>:<version> <sha256>.",
        "# Generated by `scripts/resolve_jars.py --lock` from jars/<set>/pom.xml; `make setup` resolves and verifies them.",
    ]
    for jar_set in SETS:
        lines += [f"{j.set} {j.coordinates} {j.sha256}" for j in sorted(resolved[jar_set], key=lambda j: j.coordinates)]
    LOCK.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lock", action="store_true", help="re-resolve the poms and rewrite jars/jars.lock, then install")
    mode.add_argument("--offline", action="store_true", help="only check that .jars/ holds exactly the locked files; never resolve")
    args = parser.parse_args()
    try:
        if args.lock:
            resolved = {s: maven_resolve(s) for s in SETS}
            write_lock({s: [jar for jar, _ in pairs] for s, pairs in resolved.items()})
            for jar_set, pairs in resolved.items():
                install(jar_set, pairs)
            print(f"resolve_jars: wrote {LOCK.relative_to(REPO)} ({sum(len(p) for p in resolved.values())} jars)")
            return 0
        locked = read_lock()
        for jar_set in SETS:
            pinned = [jar for jar in locked if jar.set == jar_set]
            wrong = problem(jar_set, pinned)
            if wrong is None:
                folder(jar_set).chmod(0o755)  # a folder an older resolver made 0700
                print(f"resolve_jars: {jar_set}: {len(pinned)} jars in place in {folder(jar_set)}")
                continue
            if args.offline:
                raise ResolveError(f"the {jar_set} jars are not those of {LOCK.relative_to(REPO)}: {wrong}; run `make setup`")
            print(f"resolve_jars: {jar_set}: resolving ({wrong})")
            pairs = maven_resolve(jar_set)
            compare(jar_set, pinned, [jar for jar, _ in pairs])
            install(jar_set, pairs)
            print(f"resolve_jars: {jar_set}: {len(pairs)} jars resolved, checked and installed in {folder(jar_set)}")
    except ResolveError as err:
        print(f"resolve_jars: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
