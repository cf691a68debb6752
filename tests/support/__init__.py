"""Test-only code: data builders and helpers shared by the test tiers (the fake vLLM server is ``benchmarks/``'s).

Nothing here ships in the ``eagle3_assets`` package, and no benchmark imports it. pytest puts ``tests/`` and
``benchmarks/`` on ``sys.path`` (``pythonpath`` in pyproject.toml); child processes get both through
:func:`support.common.child_env`.
"""
