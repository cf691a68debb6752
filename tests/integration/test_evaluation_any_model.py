"""draft_evaluation on a model whose tokenizer has no think tokens (Llama, Mistral, SmolLM: most instruct models),
against a stand-in `vllm` package that refuses `--reasoning-parser deepseek_r1` for such a tokenizer exactly as vLLM
does; and with both servers given by URL, nothing is started at all (the untrained baseline used to start its own).

The stand-in (as in tests/integration/test_local_vllm_server.py) is put on PYTHONPATH and run by this interpreter: it
parses vLLM's flags, answers /v1/models and chat completions with token ids (the same with and without a draft, as
greedy speculative decoding is) and per-request speculative metrics when started with a draft.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.evaluation.evaluate import EvaluationOptions, run_evaluation
from eagle3_assets.evaluation.online_metrics import OnlineConfig
from support.tokenizer_files import write_tokenizer

K = 3

STAND_IN = r"""
import argparse, hashlib, json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
for flag in ("--model", "--served-model-name", "--host", "--reasoning-parser", "--speculative-config"):
    parser.add_argument(flag)
parser.add_argument("--port", type=int)
args, rest = parser.parse_known_args()
print("stand-in argv", json.dumps(sys.argv[1:]), flush=True)
if args.reasoning_parser == "deepseek_r1":
    # vLLM's BaseThinkingReasoningParser: looks both tokens up in tokenizer.get_vocab()
    data = json.load(open(os.path.join(args.model, "tokenizer.json")))
    vocab = set(data["model"]["vocab"]) | {t["content"] for t in data.get("added_tokens", [])}
    if not {"<think>", "</think>"} <= vocab:
        print("RuntimeError: DeepSeekR1ReasoningParser reasoning parser could not locate think start/end tokens in "
              "the tokenizer!", flush=True)
        sys.exit(1)
k = json.loads(args.speculative_config)["num_speculative_tokens"] if args.speculative_config else 0

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, payload):
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.reply({"object": "list", "data": [{"id": args.served_model_name}]})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        seed = hashlib.sha256(json.dumps(request["messages"]).encode()).digest()
        ids = [b % 50 for b in seed[: min(6, request["max_tokens"])]]
        payload = {
            "id": "x", "object": "chat.completion", "created": 0, "model": request["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(map(str, ids))},
                         "finish_reason": "stop", "token_ids": ids}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)},
        }
        if k:  # two verify steps per request: one accepted everything, one nothing
            histogram = [1] + [0] * (k - 1) + [1]
            payload["metrics"] = {"speculative_decoding": {"acceptance_histogram": histogram,
                                                           "num_draft_tokens": 2 * k, "num_spec_steps": 2}}
        self.reply(payload)

ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "stand-in" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for folder in (pkg, pkg.parent, pkg.parent.parent):
        (folder / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stand-in"))
    return tmp_path / "stand-in"


@pytest.fixture(scope="module")
def no_think_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(verifier, trained draft): the tests' tiny verifier's weights with a tokenizer that has no think tokens."""
    import torch

    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft
    from support.hidden_states_data import cached_tiny_verifier

    root = tmp_path_factory.mktemp("no-think")
    verifier = root / "verifier"
    verifier.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(cached_tiny_verifier() / name, verifier / name)
    write_tokenizer(verifier, think_tokens=False)
    torch.manual_seed(0)
    build_draft(verifier, [1, 2, 3], TrainConfig(ttt_steps=K), None).save_pretrained(str(root / "draft"))
    return verifier, root / "draft"


def _options(tmp_path: Path, **online: object) -> EvaluationOptions:
    config = OnlineConfig(
        prompt_sets=("humaneval",),
        humaneval_prompts=3,
        speed_prompts=2,
        concurrency=2,
        python=Path(sys.executable),
        log_dir=tmp_path / "logs",
        **online,  # type: ignore[arg-type]
    )
    return EvaluationOptions(k=K, offline=False, online_config=config)


def test_evaluation_on_a_tokenizer_without_think_tokens(
    stand_in: Path, no_think_model: tuple[Path, Path], tmp_path: Path
) -> None:
    verifier, draft = no_think_model
    layout = DataLayout.at(tmp_path / "data")
    report = run_evaluation(layout, draft, verifier, _options(tmp_path), log=lambda line: None)
    logs = sorted((tmp_path / "logs").glob("vllm-*.log"))
    assert len(logs) == 3  # plain, trained, untrained: each started without a reasoning parser
    for log in logs:
        argv = json.loads(log.read_text().split("stand-in argv ", 1)[1].splitlines()[0])
        assert "--reasoning-parser" not in argv
    trained = report.get("trained", "online", "humaneval")
    assert trained is not None and trained.drafts == 2 * 3 and trained.mean_acceptance_length == 1 + K / 2
    assert report.run("humaneval").mismatches == {"trained": [], "untrained": []}  # type: ignore[union-attr]
    assert report.speedup("trained", "humaneval") is not None
    assert "| humaneval | trained | online | 6 | 2.500 |" in report.markdown()


@contextmanager
def _deployed(stand_in: Path, model: Path, draft: Path | None) -> Iterator[str]:
    """The stand-in started by hand, as a deployment the evaluation is given by URL."""
    import subprocess
    import time
    import urllib.request

    from eagle3_assets.net.ports import find_free_port

    port = find_free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port)]
    if draft is not None:
        cmd += ["--speculative-config", json.dumps({"model": str(draft), "num_speculative_tokens": K})]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={"PYTHONPATH": str(stand_in), "PATH": ""})
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120  # a loaded 2-core machine imports the stand-in slowly
        while True:
            try:
                urllib.request.urlopen(f"{url}/models", timeout=1).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "the stand-in server never answered"
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_servers_given_by_url_start_nothing(stand_in: Path, no_think_model: tuple[Path, Path], tmp_path: Path) -> None:
    verifier, draft = no_think_model
    layout = DataLayout.at(tmp_path / "data")
    with _deployed(stand_in, verifier, None) as plain, _deployed(stand_in, verifier, draft) as spec:
        # no vLLM interpreter at all: any server the evaluation tried to start would fail
        options = _options(tmp_path, plain_url=plain, draft_url=spec, served_model_name="m")
        options.online_config.python = tmp_path / "no-vllm" / "python"
        report = run_evaluation(layout, draft, verifier, options, log=lambda line: None)
    assert {(s.label, s.method) for s in report.stats} == {("trained", "online")}
    assert any("untrained baseline: offline only" in note for note in report.notes)
    assert not (tmp_path / "logs").exists()


def test_the_asset_and_the_cli_pass_the_settings_through(
    stand_in: Path, no_think_model: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from eagle3_assets.cli.evaluate_command import main
    from eagle3_assets.defs.evaluation import DraftEvaluationRunConfig, evaluation_options
    from eagle3_assets.defs.resources import EvaluationServersResource, VerifierResource

    layout = DataLayout.at(tmp_path / "data")
    run_config = DraftEvaluationRunConfig(humaneval_prompts=5, speed_prompts=2, concurrency=16)
    servers = EvaluationServersResource(prompt_sets="humaneval")
    verifier = VerifierResource(reasoning_parser="none", device="cpu")
    options = evaluation_options(run_config, servers, layout, verifier)
    online = options.online_config
    assert (online.prompt_sets, online.humaneval_prompts, online.speed_prompts, online.concurrency) == (
        ("humaneval",),
        5,
        2,
        16,
    )
    assert online.reasoning_parser == "none" and options.device == "cpu"

    verifier_dir, draft = no_think_model
    argv = ["--draft", str(draft), "--verifier", str(verifier_dir), "--data-dir", str(layout.root), "--online-only"]
    argv += ["--prompt-sets", "humaneval", "--humaneval-prompts", "2", "--speed-prompts", "1", "--no-untrained"]
    argv += ["--vllm-python", sys.executable, "--out", str(tmp_path / "report")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| humaneval | none (plain verifier) | online |" in printed and "| humaneval | trained | online |" in printed
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["online"]["humaneval"]["prompts"] == 2 and data["online"]["humaneval"]["speed_prompts"] == 1
    assert main([*argv[:6], "--prompt-sets", "mmlu"]) == 2
    assert "unknown prompt set 'mmlu'" in capsys.readouterr().err
