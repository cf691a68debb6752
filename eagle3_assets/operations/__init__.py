"""Operating the pipeline from the command line against a Dagster instance (``DAGSTER_HOME``).

- ``backfill``: find the partitions that are missing or failed in the instance and launch one asset
  backfill for them through the daemon (the same object the UI's "Materialize missing" creates).
- ``sync``: record partition files found on disk as materializations when the instance lost them.
- ``status``: files on disk beside Dagster's record, per partition.

Everything talks to the instance API directly (no running webserver needed); the daemon must run for a
launched backfill to make progress. Dagster is imported inside functions so ``eagle3 --help`` stays fast.
"""
