"""Test-only code: the fake vLLM server, data builders, and helpers shared by the test tiers and benchmarks.

Nothing here ships in the ``eagle3_assets`` package. pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in
pyproject.toml); benchmarks and child processes get it through :func:`support.common.child_env`.
"""
