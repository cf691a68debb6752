"""The lying servers' bodies and the memory bounds of the bounded-body tests (issue 31, clause 5):
``tests/integration/test_safety_bounded_bodies.py`` (generation) and ``..._clients.py`` (every other HTTP client).

A lying server answers 200 and never ends the body: it trickles a byte at a time, always inside any idle or
per-read timeout, or sends an endless one as fast as it is read, until it gives up after ``NEVER_ENDING_S``.
"""

from __future__ import annotations

from fake_vllm import FakeConfig

# a byte every 0.2 s: five per second, each well inside any idle (socket read) timeout of the tests
TRICKLE_INTERVAL_S = 0.2
# how long a lying server keeps a never-ending body going: before the fix a trickle held each attempt this long (then
# ended as a cut connection), so a test ends instead of hanging, and fails on the wall time
NEVER_ENDING_S = 12.0
# a child's growth in resident memory over its own baseline: a few MB to ~45 MB measured (its working memory, and
# each request's body stopped at its limit, ~1-2 MB for a reply, 16 MB for a page, buffered at most twice); before
# the fix an endless body grew the child by hundreds of MB a second
GROWTH_LIMIT_MB = 100
# the child is killed past this growth (the test then fails): the old code would otherwise take gigabytes
KILL_GROWTH_MB = 600


def never_ending(fault: str) -> FakeConfig:
    """The fake vLLM with every chat completion's body lying: ``fault`` "trickle" or "endless"."""
    return FakeConfig(faults={fault: 1.0}, trickle_interval_s=TRICKLE_INTERVAL_S, hang_s=NEVER_ENDING_S)
