"""Issue 22 (item 7): a bad input fails with an error that names the file, the setting and the remedy.

- a corrupt Parquet prompt file (before: a bare polars ComputeError without the path);
- a data directory that cannot be written (before: a raw OSError on ``_locks`` deep inside a step);
- an extraction server that refuses the key (before: "no model list", or retried and benched like an outage).
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
from support.common import error_chain, make_resources, write_jsonl
from support.fake_extraction import ExtractionFake, serve_extraction

pytestmark = pytest.mark.timeout(120, method="thread")


def test_a_corrupt_parquet_prompt_file_names_the_file_and_the_setting(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    import polars as pl

    good = tmp_path / "good.parquet"
    pl.DataFrame({"id": ["a", "b"], "prompt": ["one", "two"]}).write_parquet(good)
    corrupt = tmp_path / "prompts.parquet"
    data = good.read_bytes()
    corrupt.write_bytes(data[: len(data) // 2] + b"\0" * 64 + data[-8:])  # a cut download with a valid-looking footer
    with pytest.raises(Exception) as caught:
        dg.materialize([raw_prompts], instance=instance, resources=make_resources(layout, corrupt))
    text = error_chain(caught.value)
    assert "EAGLE3_PROMPTS_PATH" in text and str(corrupt) in text and "not a readable Parquet file" in text, text


def test_an_unwritable_data_dir_fails_at_the_start_naming_the_setting(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")  # a file where the data directory's parent should be: unwritable, even for root
    layout = DataLayout.at(blocker / "data")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "one"}])
    with pytest.raises(Exception) as caught:
        dg.materialize([raw_prompts], instance=instance, resources=make_resources(layout, prompts))
    text = error_chain(caught.value)
    assert f"EAGLE3_DATA_DIR={str(blocker / 'data')!r}: cannot write there" in text, text


def test_a_lock_folder_that_cannot_be_created_names_the_lock_and_the_setting(layout: DataLayout) -> None:
    asset_dir = layout.asset_dir("synthetic_responses")
    asset_dir.mkdir(parents=True)
    (asset_dir / "_locks").write_text("in the way")  # e.g. a read-only or broken mount under the data dir
    config = GenerationConfig(base_urls=["http://127.0.0.1:9/v1"], model="m")
    prompt = PromptToGenerate("a", [{"role": "user", "content": "hi"}])
    with pytest.raises(OSError) as caught:
        generate_partition([prompt], "00000", layout, config, log=lambda _m: None)
    text = str(caught.value)
    assert "lock file of synthetic_responses partition 00000" in text and "EAGLE3_DATA_DIR" in text, text
    assert str(asset_dir / "_locks") in text


def test_an_extraction_server_refusing_the_key_says_check_the_api_key(tmp_path: Path) -> None:
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackend, VLLMBackendOptions
    from support.hidden_states_data import cached_tiny_verifier

    with serve_extraction(ExtractionFake(tmp_path, basic_auth="alice:right")) as url:
        options = VLLMBackendOptions(urls=(url,), storage_path=str(tmp_path), api_key="sk-wrong")
        with pytest.raises(ConfigError, match="refused the API key; check EAGLE3_API_KEY") as caught:
            VLLMBackend(cached_tiny_verifier(), [1, 2, 3], "float32", options=options, log=lambda _m: None)
    assert "sk-wrong" not in str(caught.value) and "HTTP 401" in str(caught.value)
