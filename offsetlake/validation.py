"""The Great Expectations gate: a batch's rows are validated before its Delta commit.

Invariant 9: validation runs on the batch's transformed rows (the DataFrame about to be
written) with an ephemeral GX context, before anything is committed or any dead letter is
replaced. Under ``on_failure: fail`` a failing expectation stops the batch: nothing is
committed and the caller records a ``failed`` ledger row with the summary. Under
``quarantine`` the *records* whose rows fail a row-level expectation go to the dead-letter
table with the expectation as reason and the rest commits; a failing table-level expectation
(row count, column set, ...) still fails the batch, because no subset of rows can repair it.

The suite lives next to the pipeline YAML (``<name>.expectations.yaml`` by default)::

    expectations:
      - expect_column_values_to_not_be_null: {column: customer}
      - expect_column_values_to_be_in_set: {column: currency, value_set: [EUR, USD]}

A GX 1.x suite JSON (``{"name": ..., "expectations": [{"type": ..., "kwargs": {...}}]}``)
works too. Every entry is built into its GX expectation when the suite is loaded, so a typo
fails before anything is read.

Quarantine needs to know *which* rows GX counted as unexpected. GX on Spark only returns a
few examples, so offsetlake applies the same condition GX's Spark engine uses for the
row-level expectations it supports, and checks, per expectation, that it flags exactly as many
rows as GX reported unexpected; a mismatch fails the batch rather than quarantine the wrong rows.
"""

from __future__ import annotations

import difflib
import hashlib
import html
import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from offsetlake import json_text, storage
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import COORDINATE_COLUMNS
from offsetlake.errors import OffsetlakeError, SuiteError, ValidationFailedError
from offsetlake.plan import BatchPlan
from offsetlake.project import private

# GX sends usage analytics unless told not to; a data pipeline must not phone home.
os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")

log = logging.getLogger("offsetlake.validation")

# Row-level expectations quarantine can act on; each unexpected-row condition mirrors the
# condition of GX's Spark engine (nulls are "missing", not unexpected, except for not_null).
QUARANTINABLE = {
    "expect_column_values_to_not_be_null",
    "expect_column_values_to_be_in_set",
    "expect_column_values_to_not_be_in_set",
    "expect_column_values_to_be_between",
    "expect_column_values_to_match_regex",
    "expect_column_values_to_not_match_regex",
    "expect_column_values_to_be_unique",
}
_EXAMPLE_TEXT = 120  # characters kept of each example value


@dataclass(frozen=True)
class Expectation:
    """One suite entry: its GX type and kwargs, checked against GX when the suite was loaded."""

    index: int
    type: str
    kwargs: dict

    @property
    def label(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.kwargs.items() if k not in ("result_format", "meta"))
        return f"{self.type}({shown})"

    @property
    def row_level(self) -> bool:
        return self.type in QUARANTINABLE and not self.kwargs.get("row_condition")

    def build(self):
        from great_expectations.expectations.registry import get_expectation_impl

        return get_expectation_impl(self.type)(**self.kwargs)


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    expectations: tuple[Expectation, ...]

    def columns(self) -> set[str]:
        names = set()
        for e in self.expectations:
            for key in ("column", "column_A", "column_B"):
                if isinstance(e.kwargs.get(key), str):
                    names.add(e.kwargs[key])
            for key in ("column_list", "column_set"):
                if key in e.kwargs and e.type != "expect_table_columns_to_match_set":
                    names.update(str(c) for c in e.kwargs[key] or [])
        return names


# ---- loading ----------------------------------------------------------------------------------
_LOADED: dict[tuple[str, int, int], Suite] = {}


def load_suite(config: PipelineConfig) -> Suite | None:
    """The pipeline's suite, every entry checked against GX (once per text: ``_checked_marker``);
    None if the pipeline has none.

    Raises SuiteError naming the file and the entry (``expectations[2]``) for an unknown
    expectation (with the closest known names), bad or missing kwargs, or a malformed file.
    """
    path = config.suite_file
    if path is None:
        return None
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise SuiteError(f"expectation suite {path} does not exist", pipeline=config.name) from None
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _LOADED:
        _LOADED[key] = _parse_suite(path)
    return _LOADED[key]


# A suite's text, once every entry passed the check against Great Expectations, is remembered
# under the project's home (a file named by the digest of the text, its kind (.json or YAML),
# the GX version and _CHECKS): importing GX's expectation registry costs a command seconds, more
# than a batch of 1,000 records, and a passing batch needs nothing else of GX
# (``_all_pass_in_spark``). A new or edited suite, another GX version or another _CHECKS is
# checked again. Raise _CHECKS when _parse_entry checks more than it did.
_CHECKS = 1


def _checked_marker(text: str, suffix: str) -> Path | None:
    """Where the check of ``text`` (parsed as JSON or YAML by ``suffix``) is remembered, or None
    when GX's version cannot be read."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        gx = version("great_expectations")
    except PackageNotFoundError:
        return None
    digest = hashlib.sha256(f"{_CHECKS}\0{gx}\0{suffix}\0{text}".encode()).hexdigest()
    return private("suites-checked", digest)


def _remember_checked(marker: Path | None) -> None:
    if marker is None:
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError as err:  # a read-only home: every command checks the suite again
        log.debug("suite check not remembered at %s: %s", marker, err)


def _parse_suite(path: Path) -> Suite:
    text = path.read_text()
    marker = _checked_marker(text, path.suffix)
    checked = marker is not None and marker.exists()
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise SuiteError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}") from None
    entries = raw.get("expectations") if isinstance(raw, dict) else raw
    if not isinstance(entries, list) or not entries:
        raise SuiteError(f"{path}: expected a non-empty list under 'expectations'")
    name = raw.get("name") if isinstance(raw, dict) and raw.get("name") else path.name
    suite = Suite(str(name), path, tuple(_parse_entry(path, i, entry, against_gx=not checked) for i, entry in enumerate(entries)))
    if not checked:
        _remember_checked(marker)
    return suite


def _parse_entry(path: Path, index: int, entry: Any, against_gx: bool = True) -> Expectation:
    where = f"{path}: expectations[{index}]"
    if isinstance(entry, dict) and "type" in entry:
        kind, kwargs = entry["type"], entry.get("kwargs") or {}
    elif isinstance(entry, dict) and len(entry) == 1:
        kind, kwargs = next(iter(entry.items()))
        kwargs = kwargs or {}
    else:
        raise SuiteError(f"{where}: expected `expectation_name: {{kwargs}}` or {{type: ..., kwargs: {{...}}}}, got {entry!r}")
    if not isinstance(kind, str) or not isinstance(kwargs, dict):
        raise SuiteError(f"{where}: expected an expectation name with a mapping of kwargs, got {entry!r}")
    where = f"{where} {kind}"
    if not against_gx:  # this very text passed the check before (_checked_marker)
        return Expectation(index, kind, dict(kwargs))
    from great_expectations.expectations.registry import get_expectation_impl, list_registered_expectation_implementations

    try:
        cls = get_expectation_impl(kind)
    except Exception:
        close = difflib.get_close_matches(kind, list_registered_expectation_implementations(), n=3, cutoff=0.75)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise SuiteError(f"{where}: unknown expectation{hint}") from None
    try:
        cls(**kwargs)
    except Exception as err:
        raise SuiteError(f"{where}: bad kwargs: {_pydantic_problems(err)}") from None
    return Expectation(index, kind, dict(kwargs))


def _pydantic_problems(err: Exception) -> str:
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return str(err)
    parts = []
    for e in errors():
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "__root__")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts)


# ---- validating -------------------------------------------------------------------------------
@dataclass
class Validation:
    """What the gate decided for one batch."""

    summary: dict
    quarantine: list[Expectation]  # failed row-level expectations whose rows go to dead letters

    @property
    def passed(self) -> bool:
        return bool(self.summary["success"])


def validate_rows(rows, suite: Suite, config: PipelineConfig, plan: BatchPlan) -> Validation:
    """Run the suite on ``rows`` (a Spark DataFrame; persist it first, GX scans it several times).

    Returns the decision; raises ValidationFailedError (after writing the report) when the batch
    must not commit: any failure under ``fail``, a failing table-level expectation or an
    expectation that raised under ``quarantine``.
    """
    started = time.monotonic()
    missing = sorted(suite.columns() - set(rows.columns))
    if missing:
        raise SuiteError(
            f"{suite.path}: names column(s) {', '.join(missing)} that the batch rows do not have (rows have: {', '.join(rows.columns)})",
            pipeline=config.name,
            batch_id=plan.batch_id,
            field=missing[0],
        )
    # A passing batch pays for one Spark job when Spark alone can show the suite passes
    # (_all_pass_in_spark). Otherwise GX in two passes: BOOLEAN_ONLY for the whole suite (GX
    # bundles the unexpected counts into a few Spark jobs; measured 4 jobs, ~1.2 s on 1M rows),
    # then SUMMARY (counts, percentages, examples; ~3 jobs per expectation) only for the ones that
    # failed. 1M rows, 6 expectations, all passing: 1.2 s instead of 3.0 s with SUMMARY throughout.
    verdicts = _all_pass_in_spark(rows, suite)
    if verdicts is None:
        verdicts = _run_gx(rows, suite, list(suite.expectations), {"result_format": "BOOLEAN_ONLY"})
    failing = [e for e in suite.expectations if not verdicts[e.index].get("success")]
    details = (
        _run_gx(rows, suite, failing, {"result_format": "SUMMARY", "partial_unexpected_count": max(config.validation.examples, 1)})
        if failing
        else {}
    )
    results = [_result(e, details.get(e.index) or verdicts[e.index], config.validation.examples) for e in suite.expectations]
    failed = [e for e, r in zip(suite.expectations, results, strict=True) if not r["success"]]
    policy = config.validation.on_failure
    blocking = (
        failed
        if policy == "fail"
        else [e for e, r in zip(suite.expectations, results, strict=True) if not r["success"] and (not e.row_level or r["error"])]
    )
    summary = _summary(suite, policy, failed, blocking, rows.count(), results, started)  # rows is persisted: one cheap job
    if blocking:
        summary["report"] = write_report(config, plan, summary)
        raise ValidationFailedError(failure_message(config, plan, summary, blocking), summary, pipeline=config.name, batch_id=plan.batch_id)
    return Validation(summary, [] if not failed else failed)


# The expectations whose passing Spark can establish alone (``_unexpected``'s conditions, or the
# row count), with the kwargs that may come with them. ``mostly`` is among them: no unexpected row
# passes at any ``mostly``.
_SPARK_KWARGS = {
    "expect_column_values_to_not_be_null": {"column", "mostly"},
    "expect_column_values_to_be_in_set": {"column", "value_set", "mostly"},
    "expect_column_values_to_not_be_in_set": {"column", "value_set", "mostly"},
    "expect_column_values_to_be_between": {"column", "min_value", "max_value", "strict_min", "strict_max", "mostly"},
    "expect_column_values_to_match_regex": {"column", "regex", "mostly"},
    "expect_column_values_to_not_match_regex": {"column", "regex", "mostly"},
    "expect_table_row_count_to_be_between": {"min_value", "max_value"},
}


def _all_pass_in_spark(rows, suite: Suite) -> dict[int, dict] | None:
    """Every expectation's BOOLEAN_ONLY verdict when Spark alone shows the whole suite passes, in
    ONE aggregation over the batch: no row matches any expectation's unexpected-row condition (the
    conditions quarantine uses, which ``quarantine_reasons`` checks against GX's own counts), and
    the row count is within its bounds. None otherwise, and for a suite with an expectation, a
    kwarg or a column type this does not decide: then Great Expectations decides, as before. So a
    verdict never changes: a pass here is one GX would give, and every failure is GX's."""
    checks = spark_checks(rows, suite)
    if checks is None:
        return None
    return _verdicts(rows.agg(*checks).collect()[0].asDict(), suite)


def spark_checks(rows, suite: Suite) -> list | None:
    """The aggregate columns that decide ``_all_pass_in_spark`` (``_rows``, the row count, and
    ``_u<index>``, each expectation's unexpected rows), or None for a suite Spark does not decide."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    types = {f.name: f.dataType.typeName() for f in rows.schema.fields}
    checks = [F.count(F.lit(1)).alias("_rows")]
    for e in suite.expectations:
        if set(e.kwargs) - _SPARK_KWARGS.get(e.type, set()) or not _decidable(e, types):
            return None
        if e.type != "expect_table_row_count_to_be_between":
            checks.append(F.sum(F.when(_unexpected(e, F, Window), 1).otherwise(0)).alias(f"_u{e.index}"))
    return checks


def _verdicts(counted: dict[str, Any], suite: Suite) -> dict[int, dict] | None:
    """Every expectation passing (BOOLEAN_ONLY verdicts) when ``counted`` (``spark_checks``'
    values) shows no unexpected row and a row count within its bounds; None otherwise."""
    for e in suite.expectations:
        if e.type == "expect_table_row_count_to_be_between":
            low, high = e.kwargs.get("min_value"), e.kwargs.get("max_value")
            if (low is not None and counted["_rows"] < low) or (high is not None and counted["_rows"] > high):
                return None
        elif counted.get(f"_u{e.index}"):
            return None
    return {e.index: {"success": True} for e in suite.expectations}


def _summary(suite: Suite, policy: str, failed: list, blocking: list, rows: int, results: list, started: float) -> dict[str, Any]:
    """The validation summary a batch's ledger entry and report hold."""
    return {
        "suite": str(suite.path.name),
        "on_failure": policy,
        "success": not failed,
        "outcome": "passed" if not failed else ("failed" if blocking else "quarantined"),
        "rows_validated": rows,
        "failed": [e.label for e in failed],
        "expectations": results,
        "validated_at": datetime.now(UTC).isoformat(),
        "duration_ms": int((time.monotonic() - started) * 1000),
    }


class Undecided(Exception):
    """A gate observed during the write (``ObservedGate``) saw a row or a count the suite may
    fail on: the batch's staged files are removed, and the batch is processed again with the
    suite run before the write (Great Expectations decides every failure)."""


@dataclass
class ObservedGate:
    """A passing suite decided during the sink write: the same aggregation as
    ``_all_pass_in_spark``, observed (``DataFrame.observe``) on the rows the write job computes,
    so a passing batch pays no pass and no cache of its own. ``settle`` after the write: the
    passing ``Validation``, or ``Undecided``. Nothing is committed before ``settle``: the staged
    files are inert until a commit names them (invariant 2), so the gate still comes first
    (invariant 9)."""

    suite: Suite
    config: PipelineConfig
    plan: BatchPlan
    checks: list
    observation: Any = None

    def observed(self, rows):
        """``rows`` with the suite's aggregation observed by the next action on them."""
        from pyspark.sql import Observation

        self.observation = Observation(f"offsetlake_gate_{time.monotonic_ns()}")
        return rows.observe(self.observation, *self.checks)

    def settle(self) -> Validation:
        started = time.monotonic()
        if self.observation is None:
            raise Undecided(f"{self.plan.batch_id}: the rows were never written, so the observed suite saw nothing")
        counted = dict(self.observation.get)
        verdicts = _verdicts(counted, self.suite)
        if verdicts is None:
            raise Undecided(f"{self.plan.batch_id}: the observed suite saw rows it may fail on")
        results = [_result(e, verdicts[e.index], self.config.validation.examples) for e in self.suite.expectations]
        summary = _summary(self.suite, self.config.validation.on_failure, [], [], int(counted["_rows"]), results, started)
        return Validation(summary, [])


_NUMBERS = {"byte", "short", "integer", "long", "float", "double", "decimal"}


def _decidable(e: Expectation, types: dict[str, str]) -> bool:
    """Whether Spark compares ``e``'s column with its kwargs as GX's Spark engine does: the same
    kinds of values on both sides (no implicit cast that GX would refuse or do otherwise)."""
    k = e.kwargs
    if e.type == "expect_table_row_count_to_be_between":
        return all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (k.get("min_value"), k.get("max_value")))
    column = types.get(str(k.get("column")))
    if column is None:
        return False
    if e.type == "expect_column_values_to_not_be_null":
        return True
    if e.type in ("expect_column_values_to_match_regex", "expect_column_values_to_not_match_regex"):
        return column == "string" and isinstance(k.get("regex"), str)
    if e.type in ("expect_column_values_to_be_in_set", "expect_column_values_to_not_be_in_set"):
        values = k.get("value_set")
        if not isinstance(values, list | tuple | set) or not values:
            return False
        if column == "string":
            return all(isinstance(v, str) for v in values)
        return column in _NUMBERS and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if e.type == "expect_column_values_to_be_between":
        bounds = [k.get("min_value"), k.get("max_value")]
        numeric = all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in bounds)
        return column in _NUMBERS and numeric and any(v is not None for v in bounds)
    return False


def _result(e: Expectation, r: dict, examples: int) -> dict[str, Any]:
    """One expectation's outcome as the validation summary records it (JSON-safe)."""
    outcome = r.get("result") or {}
    info = r.get("exception_info") or {}
    return {
        "expectation": e.label,
        "type": e.type,
        "kwargs": _jsonable(e.kwargs),
        "row_level": e.row_level,
        "success": bool(r.get("success")),
        "element_count": outcome.get("element_count"),
        "unexpected_count": outcome.get("unexpected_count"),
        "unexpected_percent": _round(outcome.get("unexpected_percent")),
        "missing_count": outcome.get("missing_count"),
        "observed_value": _jsonable(outcome.get("observed_value")),
        "examples": [_jsonable(v) for v in (outcome.get("partial_unexpected_list") or [])[:examples]],
        "error": info.get("exception_message") if info.get("raised_exception") else None,
    }


def _run_gx(rows, suite: Suite, expectations: list[Expectation], result_format: dict) -> dict[int, dict]:
    """Validate ``expectations`` with an ephemeral context (in memory, no analytics, no progress
    bars); results keyed by suite entry index."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    context = gx.get_context(
        mode="ephemeral",
        project_config=DataContextConfig(
            store_backend_defaults=InMemoryStoreBackendDefaults(),
            analytics_enabled=False,
            progress_bars=ProgressBarsConfig(globally=False),
        ),
    )
    batch_definition = (
        context.data_sources.add_spark("offsetlake").add_dataframe_asset("batch").add_batch_definition_whole_dataframe("whole_batch")
    )
    gx_suite = gx.ExpectationSuite(name=suite.name)
    for e in expectations:
        expectation = e.build()
        # GX reorders results; the entry index in meta maps each one back to its suite entry
        expectation.meta = {**(expectation.meta or {}), "offsetlake_entry": e.index}
        gx_suite.add_expectation(expectation)
    batch = batch_definition.get_batch(batch_parameters={"dataframe": rows})
    outcome = batch.validate(gx_suite, result_format=result_format)
    by_index: dict[int, dict] = {}
    for r in outcome.results:
        entry = (r.expectation_config.meta or {}).get("offsetlake_entry") if r.expectation_config else None
        if entry is not None:
            by_index[int(entry)] = dict(r.to_json_dict())
    if len(by_index) != len(expectations):
        raise OffsetlakeError(f"{suite.path}: Great Expectations returned {len(by_index)} results for {len(expectations)} entries")
    return by_index


def failure_message(config: PipelineConfig, plan: BatchPlan, summary: dict, blocking: list[Expectation]) -> str:
    """The text of the ValidationFailedError the CLI prints, the Airflow task log shows and the
    ledger row keeps (the error's formatter puts the pipeline before it)."""
    by_label = {r["expectation"]: r for r in summary["expectations"]}
    lines = [
        f"batch {plan.batch_id} ({plan.describe()}) failed validation against "
        f"{summary['suite']} (on_failure: {summary['on_failure']}); nothing was committed"
    ]
    for e in blocking:
        r = by_label[e.label]
        if r["error"]:
            lines.append(f"  - {e.label}: raised {r['error']}")
            continue
        detail = [
            f"{r['unexpected_count']} unexpected of {r['element_count']} rows ({r['unexpected_percent']}%)"
            if r["unexpected_count"] is not None
            else f"observed {json.dumps(r['observed_value'], default=str)}"
        ]
        if r["examples"]:
            detail.append(f"e.g. {json.dumps(r['examples'], default=str)}")
        if summary["on_failure"] == "quarantine" and not e.row_level:
            detail.append("table-level: quarantine cannot fix it")
        lines.append(f"  - {e.label}: {', '.join(detail)}")
    lines.append(f"  report: {summary['report']}")
    hint = f"offsetlake run {config.name} --run-id {plan.run.run_id}" if not plan.run.dag_id else "clear the failed ingest task"
    if summary["on_failure"] == "fail":
        lines.append(
            f"  next: fix the suite or the data, or set validation.on_failure: quarantine in {config.source_file}, then rerun ({hint})"
        )
    else:
        lines.append(f"  next: fix the suite or the data, then rerun ({hint})")
    return "\n".join(lines)


# ---- quarantine -------------------------------------------------------------------------------
QUARANTINE_REASON = "_offsetlake_failed_expectations"


def quarantine_reasons(rows, expectations: list[Expectation], summary: dict):
    """Per failing record (coordinates), the failed expectations' labels; checks GX's counts.

    A record is quarantined whole: if any of its rows fails, none of them commits, so sink
    rows and dead letters together hold every record exactly once even for exploding transforms.
    """
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    flags = []
    for e in expectations:
        flags.append(F.when(_unexpected(e, F, Window), F.lit(e.label)).alias(f"_q{e.index}"))
    flagged = rows.select(*COORDINATE_COLUMNS[:3], *flags)
    counts = flagged.agg(*[F.count(f"_q{e.index}").alias(f"_q{e.index}") for e in expectations]).collect()[0]
    by_label = {r["expectation"]: r for r in summary["expectations"]}
    for e in expectations:
        gx_count = by_label[e.label]["unexpected_count"]
        if gx_count is not None and counts[f"_q{e.index}"] != gx_count:
            raise OffsetlakeError(
                f"{e.label}: offsetlake flags {counts[f'_q{e.index}']} rows but Great Expectations counted {gx_count} "
                "unexpected; refusing to quarantine rows that may be the wrong ones (nothing was committed)"
            )
    reasons = F.concat_ws("; ", *[F.col(f"_q{e.index}") for e in expectations])
    return (
        flagged.select(*COORDINATE_COLUMNS[:3], reasons.alias(QUARANTINE_REASON))
        .where(F.col(QUARANTINE_REASON) != "")
        .groupBy(*COORDINATE_COLUMNS[:3])
        .agg(F.concat_ws("; ", F.array_sort(F.collect_set(QUARANTINE_REASON))).alias(QUARANTINE_REASON))
    )


def _unexpected(e: Expectation, F, Window):
    """The Spark condition under which GX counts a row of ``e`` as unexpected."""
    k = e.kwargs
    column = F.col(f"`{k['column']}`")
    present = column.isNotNull()
    if e.type == "expect_column_values_to_not_be_null":
        return column.isNull()
    if e.type == "expect_column_values_to_be_in_set":
        return present & ~column.isin(list(k["value_set"])) if k.get("value_set") is not None else F.lit(False)
    if e.type == "expect_column_values_to_not_be_in_set":
        return present & column.isin(list(k["value_set"]))
    if e.type == "expect_column_values_to_match_regex":
        return present & ~column.rlike(k["regex"])
    if e.type == "expect_column_values_to_not_match_regex":
        return present & column.rlike(k["regex"])
    if e.type == "expect_column_values_to_be_unique":
        return present & (F.count(F.lit(1)).over(Window.partitionBy(column)) > 1)
    if e.type == "expect_column_values_to_be_between":
        low, high = k.get("min_value"), k.get("max_value")
        ok = F.lit(True)
        if low is not None:
            ok = ok & ((column > F.lit(low)) if k.get("strict_min") else (column >= F.lit(low)))
        if high is not None:
            ok = ok & ((column < F.lit(high)) if k.get("strict_max") else (column <= F.lit(high)))
        return present & ~ok
    raise AssertionError(f"{e.type} is not quarantinable")


def apply_quarantine(rows, parsed, validation: Validation, config: PipelineConfig, batch_id: str):
    """Split ``rows`` by ``validation.quarantine``: (kept rows, dead-letter rows, count per partition).

    Dead letters carry the record's original key, value and headers (from ``parsed``) and the
    reason ``failed expectation: <label>[; <label>...]``.
    """
    from pyspark.sql import functions as F

    from offsetlake.formats import REASON, dead_letter_rows, reasons

    bad = quarantine_reasons(rows, validation.quarantine, validation.summary).persist()
    per_partition = {
        (r["_kafka_topic"], r["_kafka_partition"]): int(r["count"])
        for r in bad.groupBy("_kafka_topic", "_kafka_partition").count().collect()
    }
    kept = rows.join(bad, list(COORDINATE_COLUMNS[:3]), "left_anti")
    coordinates = bad.select(
        F.col("_kafka_topic").alias("topic"),
        F.col("_kafka_partition").alias("partition"),
        F.col("_kafka_offset").alias("offset"),
        reasons.coded("quarantined", F.concat(F.lit("failed expectation: "), F.col(QUARANTINE_REASON))).alias("_q"),
    )
    quarantined = parsed.drop(REASON).join(coordinates, ["topic", "partition", "offset"]).withColumnRenamed("_q", REASON)
    validation.summary["quarantined_records"] = sum(per_partition.values())
    return kept, dead_letter_rows(quarantined, config.name, batch_id), per_partition, bad


# ---- report -----------------------------------------------------------------------------------
def write_report(config: PipelineConfig, plan: BatchPlan, summary: dict) -> str:
    """Write ``<lake>/_validation/<pipeline>/<batch>/<time>.html`` (+ ``.json``); returns its URI."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    folder = config.layout.validation.child(plan.batch_id)
    filesystem, root = storage.filesystem(folder)
    filesystem.create_dir(root, recursive=True)
    report_uri = storage.display_uri(storage.child(folder.path, f"{stamp}.html"))
    summary = {**summary, "report": report_uri}
    with filesystem.open_output_stream(f"{root}/{stamp}.json") as out:
        out.write(json_text.dumps({"pipeline": config.name, "batch_id": plan.batch_id, **summary}, indent=2, default=str).encode())
    with filesystem.open_output_stream(f"{root}/{stamp}.html") as out:
        out.write(render_report(config, plan, summary).encode())
    return report_uri


def render_report(config: PipelineConfig, plan: BatchPlan, summary: dict) -> str:
    e = html.escape
    colour = {"passed": "#1a7f37", "quarantined": "#9a6700", "failed": "#cf222e"}[summary["outcome"]]
    ranges = "".join(
        f"<tr><td>{e(r.topic)}</td><td>{r.partition}</td><td>{r.start}</td><td>{r.end}</td><td>{r.size}</td></tr>" for r in plan.ranges
    )
    rows = []
    for r in summary["expectations"]:
        verdict = "pass" if r["success"] else ("error" if r["error"] else "FAIL")
        unexpected = "" if r["unexpected_count"] is None else f"{r['unexpected_count']} ({r['unexpected_percent']}%)"
        observed = "" if r["observed_value"] is None else json.dumps(r["observed_value"], default=str)
        examples = ", ".join(json.dumps(v, default=str) for v in r["examples"])
        rows.append(
            f"<tr class='{'ok' if r['success'] else 'bad'}'><td><code>{e(r['type'])}</code></td>"
            f"<td><code>{e(json.dumps(r['kwargs'], default=str))}</code></td><td>{'row' if r['row_level'] else 'table'}</td>"
            f"<td>{verdict}</td><td>{e(unexpected)}</td><td>{e(observed)}</td>"
            f"<td>{e(examples)}{e(r['error'] or '')}</td></tr>"
        )
    quarantined = summary.get("quarantined_records")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>offsetlake validation: {e(config.name)} {e(plan.batch_id)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #1f2328; }}
h1 {{ font-size: 1.4rem; }} .verdict {{ color: white; background: {colour}; padding: .2rem .6rem; border-radius: 4px; }}
table {{ border-collapse: collapse; margin: 1rem 0; }} td, th {{ border: 1px solid #d0d7de; padding: .3rem .6rem; text-align: left; }}
th {{ background: #f6f8fa; }} tr.bad td {{ background: #ffebe9; }} dt {{ font-weight: 600; }} dd {{ margin: 0 0 .4rem 0; }}
</style></head><body>
<h1>Validation of pipeline <code>{e(config.name)}</code> batch <code>{e(plan.batch_id)}</code>
 <span class="verdict">{e(summary["outcome"].upper())}</span></h1>
<dl>
<dt>Suite</dt><dd>{e(summary["suite"])} (on_failure: {e(summary["on_failure"])})</dd>
<dt>Rows validated</dt><dd>{summary["rows_validated"]}</dd>
{f"<dt>Records quarantined to dead letters</dt><dd>{quarantined}</dd>" if quarantined is not None else ""}
<dt>Run</dt><dd>{e(plan.run.dag_id or "cli")} / {e(plan.run.run_id)} (try {plan.run.try_number or 1})</dd>
<dt>Validated at</dt><dd>{e(summary["validated_at"])} in {summary["duration_ms"]} ms</dd>
</dl>
<h2>Offset ranges</h2>
<table><tr><th>topic</th><th>partition</th><th>start</th><th>end (exclusive)</th><th>records</th></tr>{ranges}</table>
<h2>Expectations</h2>
<table><tr><th>expectation</th><th>kwargs</th><th>level</th><th>result</th><th>unexpected</th><th>observed</th>
<th>examples / error</th></tr>{"".join(rows)}</table>
<p>Passing expectations are checked with GX's BOOLEAN_ONLY result format; counts, observed values and
examples are computed for the ones that fail.</p>
</body></html>
"""


# ---- small helpers ----------------------------------------------------------------------------
def _short(value: Any) -> str:
    text = json_text.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def _jsonable(value: Any) -> Any:
    """Plain JSON values, long strings cut, so summaries fit in ledger rows and commit metadata."""
    value = json.loads(json_text.dumps(value, default=str))
    if isinstance(value, str) and len(value) > _EXAMPLE_TEXT:
        return value[:_EXAMPLE_TEXT] + "..."
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value
