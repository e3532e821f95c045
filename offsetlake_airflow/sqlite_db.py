"""Connect arguments for Airflow's SQLite metadata database (the embedded default only).

Four Airflow services share one SQLite file. Python's sqlite3 gives up on a lock after 5 s and
Airflow then answers 503 ("Database is locked") or 500; on a busy 2-core machine a scheduler loop
holds the write lock longer than that. Waiting up to a minute turns those refusals into a short
wait. Named by ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS`` (and ``..._ASYNC``) in
``scripts/local_airflow.py``; a PostgreSQL home (the compose stack) does not use it.
"""

SQLITE_CONNECT_ARGS = {"timeout": 60.0}
