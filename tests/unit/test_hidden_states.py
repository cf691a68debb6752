"""hidden_states: rendering + loss mask, layer-id validation, the stored layout (read back by speculators' own
loader and compared with a plain transformers forward), resume, disk-space refusal, and a real SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import DataLayout, DiskSpaceError
from eagle3_assets.core.verifier import resolve_layer_ids
from eagle3_assets.hidden_states import (
    HiddenStatesConfig,
    check_finite,
    check_one_per_ok_response,
    check_token_ids,
    extract_partition,
)
from eagle3_assets.hidden_states.backends import plan_batches
from eagle3_assets.hidden_states.extract import hs_file
from eagle3_assets.hidden_states.versions import hidden_states_staging_dir
from support.common import reaped, sigkill_when
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

REPO = Path(__file__).resolve().parents[2]
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def verifier() -> Path:
    return cached_tiny_verifier()


@pytest.fixture(scope="module")
def tokenizer(verifier: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(verifier))


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory, verifier: Path):
    layout = DataLayout.at(tmp_path_factory.mktemp("hs") / "data")
    fabricate_responses(layout, "00000", 40, failed_every=8)
    result = extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=LAYERS, max_seq_len=160))
    return layout, result


# ------------------------------------------------------------------------------------------------ render


def test_loss_mask_covers_exactly_the_assistant_turn(tokenizer) -> None:
    from eagle3_assets.hidden_states.render import ChatRenderer

    renderer = ChatRenderer(tokenizer, max_seq_len=10_000)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"}]
    sample = renderer.render(messages, "two and two make four", "the answer is four")
    prompt_ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    if isinstance(prompt_ids, dict):
        prompt_ids = prompt_ids["input_ids"]
    n_prompt = sample.loss_mask.index(1)
    # everything the model saw before it started generating is masked out, everything after is trained on
    assert sample.input_ids[:n_prompt] == list(prompt_ids)[:n_prompt]
    assert all(sample.loss_mask[n_prompt:])
    assistant_text = tokenizer.decode(sample.input_ids[n_prompt:])
    assert "two and two make four" in assistant_text and "the answer is four" in assistant_text
    assert "what is two plus two" not in assistant_text
    assert tokenizer.eos_token in assistant_text  # the end-of-turn token is a draft target too


def test_generation_tags_and_prefix_diff_agree(tokenizer) -> None:
    """A template that marks the turn with {% generation %} gives the same mask as the prefix/full diff."""
    import copy

    from eagle3_assets.hidden_states.render import ChatRenderer

    tagged = copy.deepcopy(tokenizer)
    template = tokenizer.chat_template
    # the branch that renders the answer being trained on (the last assistant turn, with its think block)
    marker = "{%- elif message['role'] == 'assistant' %}"
    assert marker in template, "the tiny verifier's chat template changed shape: update this test"
    start = template.index(marker)
    # wrap the assistant branch's output expression in generation tags
    head, rest = template[:start], template[start:]
    branch_end = rest.index("{%- else %}")
    branch = rest[:branch_end]
    out_start = branch.index("{{-")
    tagged.chat_template = (
        head + branch[:out_start] + "{% generation %}" + branch[out_start:] + "{% endgeneration %}" + rest[branch_end:]
    )
    plain = ChatRenderer(tokenizer, 10_000)
    gen = ChatRenderer(tagged, 10_000)
    assert gen.uses_generation_tags and not plain.uses_generation_tags
    messages = [{"role": "user", "content": "say hi"}]
    a = plain.render(messages, "thinking", "hi")
    b = gen.render(messages, "thinking", "hi")
    assert a.input_ids == b.input_ids
    # the tagged span also covers the turn header the generation prompt already contains; the diff path is
    # stricter. Both must mask the whole answer and nothing of the prompt.
    assert sum(b.loss_mask) >= sum(a.loss_mask) > 0
    assert all(b.loss_mask[i] for i, m in enumerate(a.loss_mask) if m)


def test_truncation_to_max_seq_len(tokenizer) -> None:
    from eagle3_assets.hidden_states.render import ChatRenderer

    sample = ChatRenderer(tokenizer, 12).render([{"role": "user", "content": "hello " * 30}], None, "bye")
    assert sample.seq_len == 12 and sample.truncated and len(sample.loss_mask) == 12


# ------------------------------------------------------------------------------------------------ config


def test_layer_ids_validation_names_the_key() -> None:
    assert resolve_layer_ids(None, 32) == [2, 16, 29]
    assert resolve_layer_ids([1, 2, 3], 4) == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"layer_ids=None .*\[2, 2, 1\]"):
        resolve_layer_ids(None, 4)  # the EAGLE-3 default does not fit a 4-layer verifier
    with pytest.raises(ConfigError, match=r"layer_ids=\[1, 4\]"):
        resolve_layer_ids([1, 4], 4)
    with pytest.raises(ConfigError, match="increasing"):
        resolve_layer_ids([3, 1], 4)


def test_bad_layer_id_fails_before_any_work(tmp_path: Path, verifier: Path) -> None:
    layout = DataLayout.at(tmp_path)
    fabricate_responses(layout, "00000", 4)
    with pytest.raises(ConfigError, match=r"layer_ids=\[1, 2, 9\]"):
        extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=[1, 2, 9]))
    with pytest.raises(ConfigError, match="layer_ids=None"):
        extract_partition(layout, "00000", verifier, HiddenStatesConfig())


def test_plan_batches_bounds_padded_tokens() -> None:
    lengths = [5, 100, 7, 50, 50, 3, 300]
    batches = plan_batches(lengths, 120)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 120


# ------------------------------------------------------------------------------------------------ layout


def test_result_counts_and_checks(extracted) -> None:
    layout, result = extracted
    assert result.samples == 35 and result.failed_responses_excluded == 5
    assert result.stored == 35 and result.skipped_existing == 0
    assert result.tokens > 0 and result.tokens_per_s > 0 and result.bytes > 0
    assert result.index_path.exists()
    for check in (check_token_ids, check_finite, check_one_per_ok_response):
        outcome = check(layout, "00000")
        assert outcome.passed, outcome.description


def test_bytes_close_to_the_floor(extracted) -> None:
    _layout, result = extracted
    floor = result.tokens * (len(LAYERS) + 1) * result.hidden_size * 2
    assert floor <= result.bytes <= 1.05 * floor


def test_speculators_loader_reads_the_partition(extracted, verifier: Path) -> None:
    """speculators' own ArrowDataset + CollateFn + shift_batch give the shapes its trainer expects, and the
    stored states are the verifier's (aux = output_hidden_states[i], last = final norm's input)."""
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from transformers import AutoModelForCausalLM

    layout, result = extracted
    dataset = ArrowDataset(max_len=512, datapath=str(layout.hidden_states_dir("00000")), on_missing="raise")
    assert len(dataset) == result.samples
    item = dataset[0]
    t, h = item["input_ids"].shape[0], result.hidden_size
    assert item["hidden_states"].shape == (t, len(LAYERS) * h)
    assert item["verifier_last_hidden_states"].shape == (t, h)
    assert item["loss_mask"].shape == (t,) and int(item["loss_mask"].sum()) > 0
    batch = CollateFn(512, h, len(LAYERS), preprocess=shift_batch)([dataset[0], dataset[1]])
    assert batch["hidden_states"].shape == (1, 512, len(LAYERS) * h)
    assert batch["verifier_last_hidden_states"].shape == (1, 512, h)

    model = AutoModelForCausalLM.from_pretrained(str(verifier), dtype=torch.float32).eval()
    captured = []
    model.model.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    with torch.no_grad():
        out = model(item["input_ids"][None], output_hidden_states=True)
    for j, layer in enumerate(LAYERS):
        expected = out.hidden_states[layer][0].to(torch.bfloat16).float()
        assert torch.allclose(item["hidden_states"][:, j * h : (j + 1) * h].float(), expected, atol=1e-2, rtol=1e-2)
    last = captured[0][0].to(torch.bfloat16).float()
    assert torch.allclose(item["verifier_last_hidden_states"].float(), last, atol=1e-2, rtol=1e-2)
    assert not torch.allclose(last, out.hidden_states[-1][0], atol=1e-2)  # HF's last entry is post-norm


def test_float32_option(tmp_path: Path, verifier: Path) -> None:
    from safetensors import safe_open

    layout = DataLayout.at(tmp_path)
    fabricate_responses(layout, "00000", 3)
    result = extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=LAYERS, dtype="float32"))
    with safe_open(str(hs_file(result.data_dir, 0)), framework="pt") as handle:
        assert handle.get_slice("hidden_states").get_dtype() == "F32"
    with pytest.raises(ConfigError, match="dtype='float16'"):
        extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=LAYERS, dtype="float16"))


def test_resume_keeps_whole_files_and_redoes_broken_ones(tmp_path: Path, verifier: Path) -> None:
    layout = DataLayout.at(tmp_path)
    fabricate_responses(layout, "00000", 12)
    config = HiddenStatesConfig(layer_ids=LAYERS)
    first = extract_partition(layout, "00000", verifier, config)
    data_dir = first.data_dir
    hs_file(data_dir, 0).unlink()  # lost
    broken = hs_file(data_dir, 1)
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])  # truncated at its final name
    leftover = data_dir / "hidden_states" / ".hs_2.safetensors.tmp-999"
    leftover.write_bytes(b"half")  # a killed writer's temp file
    kept = {row: hs_file(data_dir, row).stat().st_mtime_ns for row in range(2, 12)}
    second = extract_partition(layout, "00000", verifier, config)
    assert (second.stored, second.skipped_existing) == (2, 10)
    assert not leftover.exists()
    assert {row: hs_file(data_dir, row).stat().st_mtime_ns for row in range(2, 12)} == kept
    assert check_token_ids(layout, "00000").passed and check_finite(layout, "00000").passed


def test_refuses_to_start_without_disk_space(tmp_path: Path, verifier: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import eagle3_assets.core.storage as storage

    layout = DataLayout.at(tmp_path)
    fabricate_responses(layout, "00000", 3)
    monkeypatch.setattr(storage, "free_bytes", lambda _path: 1000)
    with pytest.raises(DiskSpaceError, match="hidden_states partition 00000 needs about"):
        extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=LAYERS))
    assert not (layout.hidden_states_dir("00000") / "hidden_states").exists()


@pytest.mark.slow
def test_sigkill_during_extraction_recomputes_nothing_stored_whole(tmp_path: Path, verifier: Path) -> None:
    layout = DataLayout.at(tmp_path)
    fabricate_responses(layout, "00000", 400, min_words=60, max_words=120)
    script = textwrap.dedent(
        f"""
        from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
        from eagle3_assets.core.storage import DataLayout
        extract_partition(DataLayout.at({str(layout.root)!r}), "00000", {str(verifier)!r},
                          HiddenStatesConfig(layer_ids={LAYERS!r}, batch_tokens=600))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=tmp_path)
    # a partition is built aside (published whole when complete), so the killed run's files are in its staging dir
    hs_dir = hidden_states_staging_dir(layout, "00000") / "hidden_states"

    def sixty_stored() -> bool:
        return hs_dir.is_dir() and sum(1 for p in hs_dir.iterdir() if p.name.startswith("hs_")) >= 60

    with reaped(proc):
        sigkill_when(proc, sixty_stored, timeout_s=120, interval_s=0.005)
    assert not layout.hidden_states_index_path("00000").exists()  # an unfinished partition has no index
    whole = {p.name: p.stat().st_mtime_ns for p in hs_dir.iterdir() if p.name.startswith("hs_")}
    assert 60 <= len(whole) < 400
    result = extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=LAYERS, batch_tokens=600))
    assert result.skipped_existing == len(whole) and result.stored == 400 - len(whole)
    hs_dir = layout.hidden_states_dir("00000") / "hidden_states"
    assert {name: (hs_dir / name).stat().st_mtime_ns for name in whole} == whole
    assert not any(p.name.startswith(".") for p in hs_dir.iterdir())
    for check in (check_token_ids, check_one_per_ok_response):
        assert check(layout, "00000").passed


def _with_served_ids(layout: DataLayout, key: str, tokenizer, rows: int, completion_id: int | None = None) -> list:
    """Give the first ``rows`` responses of the partition vLLM's ``return_token_ids`` columns."""
    import polars as pl

    path = layout.responses_path(key)
    frame = pl.read_parquet(path)
    prompt_ids, completion_ids = [], []
    for i, record in enumerate(frame.iter_rows(named=True)):
        if i >= rows or record["status"] != "ok":
            prompt_ids.append(None)
            completion_ids.append(None)
            continue
        prompt_ids.append(
            list(
                tokenizer.apply_chat_template(
                    record["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        )
        completion_ids.append([completion_id or (7 + i), 11, 13 + i, 1])
    frame = frame.with_columns(
        pl.Series("prompt_token_ids", prompt_ids, dtype=pl.List(pl.Int64)),
        pl.Series("completion_token_ids", completion_ids, dtype=pl.List(pl.Int64)),
    )
    frame.write_parquet(path)
    return list(zip(prompt_ids, completion_ids, strict=True))


def test_served_token_ids_are_used_as_they_are(tmp_path: Path, verifier: Path, tokenizer) -> None:
    from datasets import load_from_disk

    layout = DataLayout.at(tmp_path)
    fabricate_responses(layout, "00000", 6)
    served = _with_served_ids(layout, "00000", tokenizer, rows=4)
    result = extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=LAYERS))
    assert result.served_token_ids == 4 and any("2 of 6 responses carry no token ids" in n for n in result.notes)
    dataset = load_from_disk(str(result.data_dir))
    for row, (prompt_ids, completion_ids) in enumerate(served[:4]):
        item = dataset[row]
        # exactly the server's tokens (no re-tokenization), loss on the completion only
        assert item["input_ids"].tolist() == prompt_ids + completion_ids
        assert item["loss_mask"].tolist() == [0] * len(prompt_ids) + [1] * len(completion_ids)
    # the re-rendered fallback rows still get a loss mask from the chat template
    assert dataset[4]["loss_mask"].sum() > 0 and dataset[4]["loss_mask"][0] == 0
    assert check_token_ids(layout, "00000").passed


def test_served_token_id_outside_the_verifier_vocabulary_names_the_sample(
    tmp_path: Path, verifier: Path, tokenizer
) -> None:
    layout = DataLayout.at(tmp_path)
    fabricate_responses(layout, "00000", 3)
    _with_served_ids(layout, "00000", tokenizer, rows=3, completion_id=10**6)
    with pytest.raises(ValueError, match=r"partition 00000, sample 00000-00000: token id 1000000 is outside"):
        extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=LAYERS))
    assert not layout.hidden_states_index_path("00000").exists()
