# offsetlake: `make demo` runs the main job on the embedded default; `make test` runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LINTED := offsetlake offsetlake_airflow jobs dags plugins pipelines tests scripts bench examples
# Compiled to bytecode at setup (with the installed packages: uv's --compile-bytecode): a process
# that finds no .pyc compiles every module it imports, and one with PYTHONDONTWRITEBYTECODE set (CI
# here, many containers) does so in every process: `import offsetlake.runs, airflow.sdk` and Spark
# Connect took 13.9 s without the caches and 5.1 s with them (BENCHMARKS.md, "Bytecode at setup").
PACKAGES := offsetlake offsetlake_airflow jobs dags plugins
STAMP := $(VENV)/.installed-$(shell cat requirements-setup.lock requirements.lock pyproject.toml | sha1sum | cut -c1-12)
export PYSPARK_PYTHON := $(abspath $(PY))
export PYSPARK_DRIVER_PYTHON := $(abspath $(PY))

.PHONY: setup jars lock-jars debian test test-main test-fast test-stack test-jvm torture bench bench-keyed-dv bench-engines bench-routes bench-stream demo demo-s3 compose-test airflow spark-server lint lock clean

setup: $(STAMP) jars debian ## venv + pinned packages + editable package, and the pinned jars (Delta Lake for Spark, Spark's Kafka source, the Apache Kafka broker); idempotent

jars: $(STAMP) ## resolve jars/jars.lock into .jars/ with Maven (checksums checked); a no-op, offline, when they are in place
	$(PY) scripts/resolve_jars.py

lock-jars: $(STAMP) ## after a change to jars/*/pom.xml: re-resolve and rewrite jars/jars.lock
	$(PY) scripts/resolve_jars.py --lock

debian: ## Debian's chromium (pinned in debian-packages.txt) for the browser tests, if missing
	scripts/install_debian_packages.sh

$(STAMP): requirements-setup.lock requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-setup.lock
	$(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode -r requirements.lock
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -e .
	$(PY) -m compileall -q $(PACKAGES) >/dev/null
	rm -f $(VENV)/.installed-*
	touch $@

test: setup lint test-fast test-main ## lint, the fast tier, then every other test (make test-main)

test-main: setup ## every test but the fast tier, the stack and the tests marked torture: the properties' few examples, the S3 runs and the Airflow tests: its own broker, one Spark session and one warm Spark server that CLI runs and Airflow tasks attach to, temp lakes; prints its time and the 25 slowest tests
	$(PY) -m pytest tests -m "not fast and not stack and not torture" $(PYTEST_ARGS)

test-stack: setup ## the production stack test (docker images built, compose up, driven through Airflow's REST API, down -v); not run by .ci/run: run it after a change to the Dockerfile, docker-compose.yaml, deploy/ or jars/
	$(PY) -m pytest tests -m stack -p no:cacheprovider $(PYTEST_ARGS)

test-fast: $(STAMP) ## the fast tier (a minute or two, no broker, Spark, S3 or Airflow): planner arithmetic, Selection, the DDL parser, ledger entry round trips, file stats, config validation, docs and CLI reference
	$(PY) -m pytest tests -m fast -p no:cacheprovider $(PYTEST_ARGS)

SEED ?= 1
STEPS ?= 200
MINUTES ?= 600
EXAMPLES ?= 100
AUDIT_EVERY ?= 10
torture: setup ## what make test cannot hold: the long randomized fault campaign (the Kafka sink and outbox steps included; audit --against-kafka every AUDIT_EVERY steps and at the end), then the property tests with many examples, then the jvm data path's tests, then the local twins of the also_on_s3 tests (make test runs them on S3), then the tests marked torture: make torture SEED=7 STEPS=2000 [MINUTES=600] [EXAMPLES=100]
	$(PY) tests/fault_campaign.py --seed $(SEED) --steps $(STEPS) --minutes $(MINUTES) --kafka-audit-every $(AUDIT_EVERY) --figures torture-figures.jsonl
	OFFSETLAKE_PROPERTY_EXAMPLES=$(EXAMPLES) $(PY) -m pytest tests/test_properties.py tests/test_merge_engine_properties.py -p no:cacheprovider
	OFFSETLAKE_TEST_DATA_PATH=jvm $(PY) -m pytest $(JVM_PATH_TESTS) -p no:cacheprovider
	OFFSETLAKE_ALSO_ON_S3_KINDS=local $(PY) -m pytest tests -m also_on_s3 -p no:cacheprovider
	$(PY) -m pytest tests -m torture -p no:cacheprovider

# the read path's tests (exactly once, crashes at every failpoint, hostile input, properties)
JVM_PATH_TESTS = tests/test_exactly_once_runs.py tests/test_failpoints.py tests/test_hostile_input.py tests/test_properties.py tests/test_transactions_at_the_tail.py tests/test_offsets_lost.py
test-jvm: setup ## the read path's tests again, every pipeline that can on the jvm data path (Spark's Kafka source); part of make torture
	OFFSETLAKE_TEST_DATA_PATH=jvm $(PY) -m pytest $(JVM_PATH_TESTS) -p no:cacheprovider

RECORDS ?= 2000000
REPEATS ?= 3
bench: setup ## benchmarks vs this machine's limits (raw consume/write, steady state, local vs S3, overhead, planning, memory) -> bench-results.json
	$(PY) bench/offsetlake_bench.py --records $(RECORDS) --repeats $(REPEATS) --out bench-results.json
	$(PY) bench/report.py bench-results.json

bench-keyed-dv: setup ## a keyed sink's merges: offsetlake (delta-rs) beside delta-spark MERGE with and without deletion vectors, 2M records over 100k keys -> bench-keyed-dv.json
	$(PY) bench/keyed_deletion_vectors.py --out bench-keyed-dv.json

bench-engines: setup ## merge engines (hourly aggregate, first_row) beside the append sink: time per batch, state size, a 1% backfill, 2M records over 10k keys -> bench-merge-engines.json
	$(PY) bench/merge_engines.py --out bench-merge-engines.json

bench-routes: setup ## what routes cost: one topic into one table beside the same topic routed by currency into three tables, 500k orders, medians of 3
	$(PY) bench/routing_cost.py

bench-kafka-sink: setup ## a Kafka topic as the sink: Kafka -> Kafka, 2M orders, offsetlake beside a plain transactional consume-transform-produce loop, and the cost of a transaction per batch size -> bench-kafka-sink.json
	$(PY) bench/kafka_sink.py --out bench-kafka-sink.json

bench-stream: setup ## stream mode: produce-to-commit latency at 1,000 records/s and the highest sustained rate up to 40,000/s, for the shipped orders pipeline (Spark path) -> bench-stream.json and without its transform and suite (direct path) -> bench-stream-plain.json
	$(PY) bench/stream_latency.py --out bench-stream.json
	$(PY) bench/stream_latency.py --plain --out bench-stream-plain.json

demo: setup ## embedded default: broker + one warm Spark session + generated orders + Airflow runs (incl. a failed-then-cleared one) + backfill + audit
	$(PY) scripts/demo.py

demo-s3: setup ## the same story with the lake on the embedded S3 server (moto) instead of lake/
	OFFSETLAKE_DEMO_LAKE=s3 $(PY) scripts/demo.py

compose-test: setup ## the production stack (docker-compose.yaml, Dockerfile) built and run here: installs Debian's docker.io/docker-compose/debootstrap if missing, starts the engine if needed, builds the images (a Debian-built base when the official one cannot be pulled), drives a scheduled run, a backfill and a killed-then-cleared run through Airflow's REST API, audits, then down -v
	$(PY) scripts/compose_test.py

airflow: setup ## Airflow UI and services on 127.0.0.1 (AIRFLOW_PORT, default 8080); prints the login
	$(PY) scripts/airflow_ui.py

SPARK_SERVER_PORT ?= 15002
spark-server: setup ## a warm Spark session on 127.0.0.1:SPARK_SERVER_PORT that runs (--remote / OFFSETLAKE_SPARK_REMOTE) and Airflow (spark_connect_default) attach to; Ctrl-C stops it
	$(VENV)/bin/offsetlake spark-server --port $(SPARK_SERVER_PORT)

lint: $(STAMP) ## ruff format --check, ruff (incl. C901 ≤ 15 in the library, RUF100), mypy and the import-linter contracts in pyproject.toml; needs only the venv (no apt)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/ruff check $(LINTED)
	MYPY_CACHE_DIR=$(MYPY_CACHE) $(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# mypy's cache outside the clone, shared by every clone of this machine: it checks each entry
# against the file's hash, so a fresh clone (as CI makes) re-checks only what changed, in seconds
# where a cold run takes over a minute
MYPY_CACHE ?= $(HOME)/.cache/offsetlake/mypy

lock: ## re-resolve requirements.txt into requirements.lock
	rm -rf .lockvenv && $(PYTHON) -m venv .lockvenv && .lockvenv/bin/pip install -q -r requirements.txt
	(echo "# Full lock of requirements.txt, resolved with Python 3.11 (regenerate: make lock)"; \
	 .lockvenv/bin/pip freeze --exclude-editable) > requirements.lock && rm -rf .lockvenv

clean:
	rm -rf lake .kafka .airflow .pytest_cache
