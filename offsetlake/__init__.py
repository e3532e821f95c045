"""offsetlake: exact Kafka offset ranges into Delta Lake tables, exactly once.

The Kafka offsets are the state; the Delta commit on the sink table is the checkpoint.
See docs/design.md for the numbered invariants this package keeps.
"""

__version__ = "0.1.0"
