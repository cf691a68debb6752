"""A failed online-evaluation request never inflates the reported speed-up (issue 31: the data-safety contract).

The online evaluation counts a request that got no reply (a trickled or endless body, a timeout) as failed instead
of ending the evaluation. Its tokens/s is a batch's output tokens over the batch's wall time, and a failed request
adds no tokens but keeps its wall time (up to the request timeout) in the batch: one plain-verifier speed request
that timed out made the baseline's tokens/s several times too low and the draft's speed-up several times too high,
shown as a plain number with the failure only in ``extra["failed"]``.

Here the plain verifier is the fake vLLM (``benchmarks/fake_vllm.py``, a real server process) whose body trickles for
exactly one of the speed batch's requests (the fake's seed chosen so), and the draft server the same fake, honest,
behind a proxy adding vLLM's per-request speculative metrics (``tests/support/evaluation_failures.py``). The true
speed-up is about 1 (the same fake on both sides); before the fix the report showed 13.3. Now the speed-up is
withheld wherever a speed request failed on either side (the rows say how many failed), in the report (Markdown and
JSON), the ``eagle3 evaluate`` table and the ``draft_evaluation`` asset's metadata.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.evaluation.online_metrics import OnlineConfig
from eagle3_assets.evaluation.prompt_sets import HUMANEVAL, Prompt, humaneval_prompts
from fake_vllm import FakeConfig, FakeServerProcess, draw_fault, prompt_key
from support.evaluation_failures import speculative_proxy
from support.report_table import table_row

pytestmark = pytest.mark.timeout(180, method="thread")

K = 3
PROMPTS = 4  # HumanEval problems: the acceptance batch, and again one at a time the speed batch
MAX_TOKENS = 16
TIMEOUT_S = 2.0  # each request's whole-request deadline: the trickled one fails by it
TRICKLE_RATE = 0.25
# both sides the same fake (same seed: the same greedy tokens); 16 tokens at 400 tok/s: ~0.04 s a request, so a
# speed batch of 4 answered takes ~0.2 s and one request held to its 2 s timeout makes it ~10 times slower
FAKE: dict[str, Any] = {
    "token_rate": 400.0,
    "median_tokens": float(MAX_TOKENS),
    "sigma": 0.0,
    "trickle_interval_s": 0.2,
    "hang_s": 12.0,
}
MODEL = "fake-model"
WITHHELD = "- (1 speed request failed)"


def _one_failed_speed_request(prompts: list[Prompt]) -> int:
    """A fake seed under which the plain server trickles exactly one speed request and no acceptance request (the
    fake draws each request's fault from its seed, the prompt and how often that prompt was seen before)."""
    keys = [prompt_key(p.messages) for p in prompts]
    for seed in range(1000):
        config = FakeConfig(faults={"trickle": TRICKLE_RATE}, seed=seed)
        acceptance = [draw_fault(key, 0, config) for key in keys]
        speed = [draw_fault(key, 1, config) for key in keys]
        if acceptance.count(None) == len(keys) and speed.count("trickle") == 1:
            return seed
    raise AssertionError("no seed in 0..999 trickles exactly one speed request")


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(verifier, trained draft): the tests' tiny verifier and an EAGLE-3 draft built on it."""
    import torch

    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft
    from support.hidden_states_data import cached_tiny_verifier

    verifier = cached_tiny_verifier()
    folder = tmp_path_factory.mktemp("draft")
    torch.manual_seed(0)
    build_draft(verifier, [1, 2, 3], TrainConfig(ttt_steps=K), None).save_pretrained(str(folder / "draft"))
    return verifier, folder / "draft"


@contextmanager
def _servers() -> Iterator[tuple[str, str, FakeServerProcess]]:
    """(plain URL, draft URL, the plain fake): the plain verifier trickles one speed request's body."""
    seed = _one_failed_speed_request(humaneval_prompts(PROMPTS))
    with ExitStack() as stack:
        plain = stack.enter_context(FakeServerProcess(FakeConfig(faults={"trickle": TRICKLE_RATE}, seed=seed, **FAKE)))
        honest = stack.enter_context(FakeServerProcess(FakeConfig(seed=seed, **FAKE)))
        spec = stack.enter_context(speculative_proxy(honest.base_url, K))
        yield plain.base_url, spec, plain


def _assert_withheld(markdown: str) -> None:
    """The table: failed counts, no tok/s on the failed side, no speed-up number on either row."""
    plain = table_row(markdown, HUMANEVAL, "none (plain verifier)")
    trained = table_row(markdown, HUMANEVAL, "trained")
    # before the fix: the speed-up cell was a number, 13.3 measured (1 request held the baseline batch 2 s)
    head = table_row(markdown, "prompt set", "draft")
    speedup, tps, failed = head.index("speed-up"), head.index("tok/s"), head.index("failed requests")
    assert trained[speedup] == WITHHELD, f"the speed-up is shown over a batch with a failed request:\n{markdown}"
    assert (plain[tps], plain[speedup]) == (WITHHELD, WITHHELD), markdown  # no baseline tok/s, no "1.00"
    assert (plain[failed], trained[failed]) == ("1", "0"), markdown
    assert re.fullmatch(r"\d+\.\d", trained[tps]), markdown  # the draft's own batch was whole: its tok/s stands
    assert "1 requests to the plain verifier FAILED" in markdown and "in its speed batch" in markdown, markdown


def test_a_failed_baseline_speed_request_withholds_the_speed_up(draft: tuple[Path, Path], tmp_path: Path) -> None:
    from eagle3_assets.defs.evaluation import evaluation_metadata
    from eagle3_assets.evaluation.evaluate import EvaluationOptions, run_evaluation

    verifier, draft_dir = draft
    layout = DataLayout.at(tmp_path / "data")
    logged: list[str] = []
    with _servers() as (plain_url, draft_url, plain):
        config = OnlineConfig(
            prompt_sets=(HUMANEVAL,),
            humaneval_prompts=PROMPTS,
            speed_prompts=PROMPTS,
            concurrency=PROMPTS,
            max_tokens=MAX_TOKENS,
            request_timeout_s=TIMEOUT_S,
            plain_url=plain_url,
            draft_url=draft_url,
            served_model_name=MODEL,
        )
        options = EvaluationOptions(k=K, offline=False, untrained=False, online_config=config)
        report = run_evaluation(layout, draft_dir, verifier, options, log=logged.append)
        assert plain.stats()["outcomes"].get("trickle") == 1  # the fault happened, once

    speedup = report.speedup("trained", HUMANEVAL)
    assert speedup is None, f"speed-up {speedup:.2f} reported over a baseline batch holding a failed request"
    _assert_withheld(report.markdown())
    trained = report.get("trained", "online", HUMANEVAL)
    assert trained is not None and trained.drafts == 2 * PROMPTS and trained.mean_acceptance_length == 1 + K / 2
    assert (trained.failed, trained.speed_failed) == (0, 0)

    data = json.loads((layout.evaluation_dir / "report.json").read_text())
    run = data["online"][HUMANEVAL]
    assert (run["failed"], run["speed_failed"], run["baseline_tokens_per_second"]) == (1, 1, None), run
    assert (
        data["speedup"][HUMANEVAL]["trained"] is None
        and data["summary"][HUMANEVAL]["trained (online)"]["speedup"] is None
    )
    assert any("speed batch" in line and "no speed-up" in line for line in logged), logged

    metadata = evaluation_metadata(report, layout)
    assert metadata["failed_requests_plain_humaneval"].value == 1
    assert metadata["failed_requests_trained_humaneval"].value == 0
    assert "withheld: 1 speed requests failed" in metadata["speedup_trained_humaneval"].value
    (record,) = metadata["table"].records
    assert record.data["speedup"] is None and record.data["speed_requests_failed"] == 1
    assert record.data["speedup_verdict"] == "withheld" and record.data["speedup_low"] is None


def test_the_cli_table_shows_the_failed_count(
    draft: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from eagle3_assets.cli.evaluate_command import main

    verifier, draft_dir = draft
    argv = ["--draft", str(draft_dir), "--verifier", str(verifier), "--data-dir", str(tmp_path / "data")]
    argv += ["--online-only", "--no-untrained", "--prompt-sets", HUMANEVAL, "--humaneval-prompts", str(PROMPTS)]
    argv += ["--speed-prompts", str(PROMPTS), "--concurrency", str(PROMPTS), "--max-tokens", str(MAX_TOKENS)]
    argv += ["--served-model-name", MODEL, "--vllm-python", sys.executable, "--out", str(tmp_path / "report")]
    assert main([*argv, "--request-timeout-s", "0"]) == 2
    assert "--request-timeout-s 0: must be a positive number of seconds" in capsys.readouterr().err
    with _servers() as (plain_url, draft_url, _plain):
        code = main([*argv, "--request-timeout-s", str(TIMEOUT_S), "--plain-url", plain_url, "--draft-url", draft_url])
    assert code == 0
    _assert_withheld(capsys.readouterr().out)
