"""The sinks behind one seam (docs/design.md, "The sink seam").

``reading`` says what every reader may ask a sink (its history, its committed ends, what it can
do); ``delta_reader`` and ``kafka_reader`` answer it for a Delta table and for a Kafka topic;
``choice`` is the one place that looks at ``sink.type`` and picks the implementation.
"""
