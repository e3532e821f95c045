"""The embedded default: a local Kafka-protocol broker and generated sample orders.

Used by ``make demo``, ``make airflow``, the benchmarks and the tests; never by a pipeline run.
"""
