"""What every stage stands on (Dagster-free, no stage imported): settings and their environment (``settings``), the
data layout and atomic, durable writes (``storage``), content hashes (``hashing``), what a partition was built from
(``lineage``), partition keys (``partition_keys``), check outcomes, the verifier's shape, CPU precision, and the
process-level guards (``process_guard``: children die with their parent; ``interrupts``: signals cancel work).
"""
