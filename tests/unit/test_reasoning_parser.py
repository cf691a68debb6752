"""EAGLE3_REASONING_PARSER: `auto` picks vLLM's think-block parser only for a tokenizer with <think> and </think>
(vLLM refuses the parser otherwise), every local server's command line follows it, and bad values name the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle3_assets.local.reasoning import (
    THINK_BLOCK_PARSER,
    check_reasoning_parser,
    describe,
    has_think_tokens,
    resolve_reasoning_parser,
)
from eagle3_assets.local.vllm_server import VLLMServerConfig
from support.tokenizer_files import write_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return write_tokenizer(root / "with", think_tokens=True), write_tokenizer(root / "without", think_tokens=False)


def test_auto_follows_the_tokenizer(folders: tuple[Path, Path]) -> None:
    with_think, without = folders
    assert has_think_tokens(with_think) and not has_think_tokens(without)
    assert resolve_reasoning_parser("auto", with_think) == THINK_BLOCK_PARSER == "deepseek_r1"
    assert resolve_reasoning_parser("auto", without) is None
    assert "no <think>/</think>" in describe("auto", without) and "deepseek_r1" in describe("auto", with_think)
    # explicit values are taken as given, whatever the tokenizer
    assert resolve_reasoning_parser("none", with_think) is None and resolve_reasoning_parser(None, with_think) is None
    assert resolve_reasoning_parser("qwen3", without) == "qwen3"
    # no tokenizer files at all: no parser (vLLM then reports the missing tokenizer itself)
    assert resolve_reasoning_parser("auto", without.parent / "missing") is None


def test_the_demo_tiny_verifier_keeps_its_parser() -> None:
    from support.hidden_states_data import cached_tiny_verifier

    # the project's tiny verifier answers "reasoning</think>content": auto keeps deepseek_r1 for it
    assert resolve_reasoning_parser("auto", cached_tiny_verifier()) == "deepseek_r1"


def test_every_local_server_command_follows_the_setting(folders: tuple[Path, Path]) -> None:
    with_think, without = folders
    python = Path(sys.executable)

    def parser_arg(model: Path, **kwargs: object) -> str | None:
        cmd = VLLMServerConfig(model=model, **kwargs).command(python)  # type: ignore[arg-type]
        return cmd[cmd.index("--reasoning-parser") + 1] if "--reasoning-parser" in cmd else None

    assert parser_arg(without) is None  # the default is auto: a tokenizer without think tokens gets no parser
    assert parser_arg(with_think) == "deepseek_r1"
    assert parser_arg(with_think, reasoning_parser="none") is None
    assert parser_arg(without, reasoning_parser="granite") == "granite"


def test_the_setting_is_declared_once_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from eagle3_assets.core.settings import ConfigError
    from eagle3_assets.defs.resources import VerifierResource
    from eagle3_assets.environment import env_value

    assert VerifierResource().reasoning_parser == "auto"
    assert VerifierResource.from_env({"EAGLE3_REASONING_PARSER": "none"}).reasoning_parser == "none"
    monkeypatch.setenv("EAGLE3_REASONING_PARSER", "deepseek r1; rm -rf")
    with pytest.raises(ConfigError, match="EAGLE3_REASONING_PARSER='deepseek r1; rm -rf': must be `auto`, `none`"):
        env_value("EAGLE3_REASONING_PARSER")
    assert check_reasoning_parser("k", "AUTO") == "auto" and check_reasoning_parser("k", "") == "none"
