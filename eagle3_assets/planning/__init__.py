"""``eagle3 plan``: what a run will cost, predicted before it starts (Dagster-free).

From the dataset (or a stated sample count and mean prompt length) and the verifier's config, a :class:`Plan` says
per partition how many samples and tokens there will be, how long generation, hidden-state extraction and training
take at a given rate, how many bytes the hidden states take in each storage dtype (bf16, FP8) and whether they fit
the free disk or online training is advised. Every figure carries where it came from: a measurement file (and which
of its partitions), a tokenizer, or "stated" (a number given on the command line).

The figures, and what they rest on:

* **samples per partition**: the dataset read exactly as ``raw_prompts`` reads it (``prompts.DatasetScan``: the same
  rejects, duplicates, turn selection and limit), positions in file order, ``partition_size`` a partition;
* **prompt tokens**: each prompt rendered with the verifier's chat template and tokenized (what vLLM does with a chat
  request); past ``tokenize_max`` prompts, or without a tokenizer, characters / a chars-per-token ratio (measured on
  the tokenized ones, or stated). A prompt of ``max_model_len`` tokens or more is refused by the server (HTTP 400):
  counted as failed, with no hidden states;
* **completion tokens**: a mean per ok sample measured in a previous run (its responses, or an ``eagle3 demo``
  output), else ``max_tokens``: an upper bound, and said so;
* **hidden-state bytes**: each sample file exactly as ``hidden_states/samples.write_sample`` writes it: a safetensors
  header (8 bytes of length + its JSON padded to 8) + T x ((n_aux + 1) x H x dtype bytes + FP8's per-row scales) +
  T x 8 bytes of token ids; T = min(prompt + completion, ``max_seq_len``);
* **disk**: the extraction's own free-space estimate (``samples.estimate_bytes``, with ``storage.ensure_free_space``'s
  headroom) against the free bytes at the data directory;
* **times**: tokens / rate. Generation counts output tokens, extraction every stored token, training every training
  token (all partitions but the last, which is held out for validation) once per epoch.

Evaluation, the verifier build and server start-ups are fixed costs that do not grow with the dataset: not planned.
"""

from __future__ import annotations

from eagle3_assets.planning.inputs import (
    NO_RATE,
    PLANNED_DTYPES,
    Completion,
    ModelShape,
    PlanError,
    Prompts,
    Rate,
    chat_token_counter,
    dataset_prompts,
    model_shape,
    sample_file_bytes,
    stated_prompts,
    stated_rate,
)
from eagle3_assets.planning.measured import (
    MeasuredPartition,
    MeasuredRun,
    measured_completion,
    measured_rate,
    read_measured,
    responses_completion,
)
from eagle3_assets.planning.plan import DISK_HEADROOM, PartitionPlan, Plan, StagePlan, build_plan, free_at
from eagle3_assets.planning.plan_report import Comparison, compare, render

__all__ = [
    "DISK_HEADROOM",
    "NO_RATE",
    "PLANNED_DTYPES",
    "Comparison",
    "Completion",
    "MeasuredPartition",
    "MeasuredRun",
    "ModelShape",
    "PartitionPlan",
    "Plan",
    "PlanError",
    "Prompts",
    "Rate",
    "StagePlan",
    "build_plan",
    "chat_token_counter",
    "compare",
    "dataset_prompts",
    "free_at",
    "measured_completion",
    "measured_rate",
    "model_shape",
    "read_measured",
    "render",
    "responses_completion",
    "sample_file_bytes",
    "stated_prompts",
    "stated_rate",
]
