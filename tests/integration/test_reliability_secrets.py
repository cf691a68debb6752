"""Issue 8, secrets: with EAGLE3_API_KEY set (and the fake server requiring it), the whole graph runs the way
`eagle3 demo` runs it (definitions and resources built from the EAGLE3_* environment, Dagster's materialize() on a
real on-disk instance in a temporary DAGSTER_HOME, every asset in order, every partition): raw_prompts,
synthetic_responses, hidden_states, vocab_mapping, draft_model and draft_evaluation (offline: no vLLM here); then a
run with a wrong key fails. Neither key, nor the password in EAGLE3_HIDDEN_STATES_URL, appears in any file under the
data directory (the draft's training_history.json included) or DAGSTER_HOME (SQLite event log and run storage, its
compressed run configs and job snapshots decoded, compute logs), in any Dagster event, run record or asset metadata,
or in the captured output (URL passwords in all Dagster stores or shows: tests/integration/test_safety_secrets.py).
(The engine alone is covered by tests/unit/test_generation_engine.py::test_api_key_is_sent_and_never_written.)

The local vLLM server gets a key only through its environment (VLLM_API_KEY, which vLLM reads), never on its command
line, which `ps` shows to every user of the machine; a stand-in `vllm` package (as in
tests/integration/test_local_vllm_server.py) shows what the server process receives without a 100-second vLLM
start-up."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from urllib.parse import quote

import dagster as dg
import pytest
from dagster._serdes import serialize_value

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.local import vllm_server as vs
from eagle3_assets.net.ports import find_free_port
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import fake_server_pipeline_env, write_jsonl
from support.secrets import leaks, password_forms, sqlite_texts, with_password

SECRET = "sk-reliability-7f3a9c-do-not-leak"
WRONG = "sk-wrong-key-5e1b2d-do-not-leak-either"
# In EAGLE3_HIDDEN_STATES_URL (percent-encoded there): the hf backend never contacts it, but draft_model's training
# config carries the extraction URLs, and its training_history.json is stored next to the draft.
URL_USER = "bob"
URL_PASSWORD = "hs4e1f@pass9c2b,word3a7d"
GOOD_PARTITIONS = ["00000", "00001"]  # one trains the draft, the other is held out
REFUSED_PARTITION = "00002"
# Sized to seconds on 2 cores; the shapes and code paths are the demo's (eagle3_assets/operations/demo.py).
ASSET_CONFIG: dict[str, dict[str, object]] = {
    "vocab_mapping": {"draft_vocab_size": 256},
    "draft_model": {"epochs": 1, "tokens_per_batch": 256, "max_steps_per_epoch": 2, "max_val_batches": 1},
    "draft_evaluation": {"online": False, "offline_max_samples": 2},
}


def _files_with(root: Path, needles: list[bytes]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {needle!r}" for needle in needles if needle in data]
    return hits


def _run_stage(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    name: str,
    partition: str | None = None,
    raise_on_error: bool = True,
) -> dg.ExecuteInJobResult:
    """One asset (one partition of it) the way the demo materializes it, with this test's small config."""
    from eagle3_assets.operations.demo import materialize_asset

    config = {"ops": {name: {"config": ASSET_CONFIG[name]}}} if name in ASSET_CONFIG else None
    return materialize_asset(defs, instance, name, partition, config, raise_on_error)


def _materialize_pipeline(defs: dg.Definitions, instance: dg.DagsterInstance) -> dict[str, dict]:
    """Every stage in order, every good partition; returns each materialization's metadata by "name partition"."""
    graph = defs.resolve_asset_graph()
    # the opt-in regeneration_ablation is not one of the pipeline's stages
    order = [k.to_user_string() for k in graph.toposorted_asset_keys if k.to_user_string() != "regeneration_ablation"]
    assert order == [
        "raw_prompts",
        "synthetic_responses",
        "hidden_states",
        "vocab_mapping",
        "draft_model",
        "draft_evaluation",
    ]
    materialized: dict[str, dict] = {}
    for name in order:
        partitions = GOOD_PARTITIONS if graph.get(dg.AssetKey(name)).partitions_def else [None]
        for partition in partitions:
            result = _run_stage(defs, instance, name, partition)
            assert result.success, (name, partition)
            materialized[f"{name} {partition}"] = result.asset_materializations_for_node(name)[0].metadata
    return materialized


def _instance_records(instance: dg.DagsterInstance) -> tuple[list[str], list[str], list[str]]:
    """(events, runs, decoded) as text: every run's event log, every run record, and the stored run configs and job
    snapshots decoded, since they are stored compressed, out of reach of a byte search."""
    events = [str(record) for run_ in instance.get_runs() for record in instance.all_logs(run_.run_id)]
    runs = [str(run_) for run_ in instance.get_runs()]
    decoded = [json.dumps(run_.run_config) for run_ in instance.get_runs()]
    decoded += [serialize_value(instance.get_job_snapshot(r.job_snapshot_id)) for r in instance.get_runs()]
    return events, runs, decoded


@pytest.mark.slow
def test_api_key_appears_in_no_file_event_or_log(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from eagle3_assets.definitions import build_definitions

    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": f"k{i}", "prompt": f"secret test {i}"} for i in range(12)])
    caplog.set_level(logging.DEBUG)
    with (
        FakeServerProcess(FakeConfig(token_rate=5000, median_tokens=30, api_key=SECRET)) as server,
    ):
        env = {
            **fake_server_pipeline_env(dagster_home, layout, dataset, server.base_url),
            "EAGLE3_API_KEY": SECRET,
            "EAGLE3_HIDDEN_STATES_URL": with_password("http://127.0.0.1:9/v1", URL_USER, quote(URL_PASSWORD, safe="")),
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        defs = build_definitions()  # resources from the environment, as `dagster dev` and the demo load them
        with dg.DagsterInstance.get() as instance:
            assert Path(instance.root_directory) == dagster_home  # a real on-disk instance, like `make dev`
            materialized = _materialize_pipeline(defs, instance)
            assert materialized["synthetic_responses 00000"]["ok"].value == 4
            assert (layout.draft_model_dir / "final" / "model.safetensors").exists()
            assert (layout.evaluation_dir / "report.json").exists()

            monkeypatch.setenv("EAGLE3_API_KEY", WRONG)  # read when the run starts: the server refuses it
            refused = _run_stage(defs, instance, "synthetic_responses", REFUSED_PARTITION, raise_on_error=False)
            assert not refused.success
            failure = refused.get_step_failure_events()[0].event_specific_data.error
            assert failure is not None and "API key" in failure.to_string()

            events, runs, decoded = _instance_records(instance)
    history = json.loads((layout.draft_model_dir / "training_history.json").read_text())
    assert history["config"]["online_urls"] == ["http://***@127.0.0.1:9/v1"]  # which server, not its password
    stored_anywhere = [text for _where, text in sqlite_texts(dagster_home)]
    assert any("EAGLE3_HIDDEN_STATES_URL" in text for text in stored_anywhere)  # the snapshots were decoded
    for text in stored_anywhere + decoded:
        assert not leaks("Dagster's storage", text, [SECRET, WRONG, *password_forms(URL_USER, URL_PASSWORD)])
    needles = [SECRET.encode(), WRONG.encode(), *(form.encode() for form in password_forms(URL_USER, URL_PASSWORD))]
    assert len(runs) == 1 + 2 * len(GOOD_PARTITIONS) + 3 + 1 and len(events) > 100
    metadata = [repr(value) for values in materialized.values() for value in values.values()]
    for text in events + runs + metadata:
        assert SECRET not in text and WRONG not in text
    assert not _files_with(layout.root, needles)
    assert any(dagster_home.rglob("*.db")), list(dagster_home.rglob("*"))  # the SQLite storage was searched
    assert not _files_with(dagster_home, needles)
    assert not _files_with(tmp_path, needles)  # anything else the runs left in the temporary folder
    captured = capfd.readouterr()
    output = captured.out + captured.err + caplog.text
    for line in ("synthetic_responses 00000", "hidden_states 00001", "draft_model epoch 1/1"):
        assert line in output, line  # the runs' log lines were captured, so they were searched
    assert not leaks("the captured output", output, [SECRET, WRONG, *password_forms(URL_USER, URL_PASSWORD)])


# A stand-in for vLLM's OpenAI server. With STAND_IN_ENFORCE=1 it requires ``Authorization: Bearer $VLLM_API_KEY``
# on /v1/* as vLLM does (its AuthenticationMiddleware) when that variable is set. It logs a digest of the key it got,
# and from where, so the log can be searched for the key itself.
STAND_IN = """
import argparse, hashlib, json, os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--served-model-name"); parser.add_argument("--host"); parser.add_argument("--port", type=int)
parser.add_argument("--api-key")
args, _rest = parser.parse_known_args()
key = args.api_key or os.environ.get("VLLM_API_KEY")
digest = hashlib.sha256(key.encode()).hexdigest() if key else None
print("stand-in got", json.dumps({"sha256": digest, "on_command_line": bool(args.api_key)}), flush=True)
enforce = key if os.environ.get("STAND_IN_ENFORCE") == "1" else None

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        allowed = not enforce or self.headers.get("Authorization") == f"Bearer {enforce}"
        body = json.dumps({"object": "list", "data": [{"id": args.served_model_name}]}).encode()
        self.send_response(200 if allowed else 401)
        self.end_headers()
        self.wfile.write(body if allowed else b'{"error": "Unauthorized"}')
    def log_message(self, *a):
        pass

try:
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
except KeyboardInterrupt:
    pass
"""


def _stand_in_config(tmp_path: Path, enforce: bool, **overrides: object) -> vs.VLLMServerConfig:
    package = tmp_path / "stand_in" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(STAND_IN)
    (tmp_path / "model").mkdir()
    values: dict[str, object] = {
        "model": tmp_path / "model",
        "served_model_name": "tiny",
        "port": find_free_port(),
        "python": Path(sys.executable),
        "extra_env": {"PYTHONPATH": str(tmp_path / "stand_in"), "STAND_IN_ENFORCE": "1" if enforce else "0"},
        "log_dir": tmp_path / "logs",
        "startup_timeout_s": 30.0,
        **overrides,
    }
    return vs.VLLMServerConfig(**values)  # type: ignore[arg-type]


def test_local_vllm_server_gets_a_key_only_through_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With EAGLE3_API_KEY and VLLM_API_KEY set, the server's command line (``/proc/PID/cmdline``, what ``ps``
    shows) and its log (the command written at its top included) hold neither; the key reaches the server process
    through its environment. The stand-in does not enforce the key here: see the next test."""
    monkeypatch.setenv("EAGLE3_API_KEY", SECRET)
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    config = _stand_in_config(tmp_path, enforce=False)
    with vs.LocalVLLMServer(config) as server:
        assert server.process is not None and server.healthy()
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert b"api_server" in cmdline and b"--served-model-name" in cmdline  # the server itself, after the exec
        assert SECRET.encode() not in cmdline
    log = (tmp_path / "logs" / f"vllm-{config.port}.log").read_text()
    assert log.startswith("$ ") and "--served-model-name" in log.splitlines()[0]
    got = json.loads(log.split("stand-in got ", 1)[1].splitlines()[0])
    assert got == {"sha256": hashlib.sha256(SECRET.encode()).hexdigest(), "on_command_line": False}
    assert SECRET not in log


def test_local_vllm_server_given_a_key_through_its_environment_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key passed the safe way (VLLM_API_KEY) must not stop the server from starting: the health check has to
    send it, as every client of that server does."""
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    with vs.LocalVLLMServer(_stand_in_config(tmp_path, enforce=True, startup_timeout_s=5.0)) as server:
        assert server.healthy()
