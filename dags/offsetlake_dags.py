"""offsetlake's DAGs: `<pipeline>_ingest`, `_backfill`, `_rewind` and `_stream` for every pipelines/*.yaml.

Thin on purpose: the factory (``offsetlake_airflow.dag_factory``) reads only the YAML files.
"""

from offsetlake_airflow.dag_factory import pipeline_dags

globals().update(pipeline_dags())
