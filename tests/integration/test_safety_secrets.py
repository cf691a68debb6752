"""Issue 31, clause 6: secrets are stored nowhere. A server URL's password (``http://user:pw@host/v1``, the password
holding a comma, the URL list's separator, and an ``@``, the userinfo's end; or percent-encoded, ``%40``) and
``EAGLE3_API_KEY`` never reach what Dagster keeps or shows, ``eagle3 config`` or an error text.

Dagster 1.13 keeps each run's job snapshot zlib-compressed in ``DAGSTER_HOME/history/runs.db``: a byte search of the
files cannot see into it, so every stored thing is DECODED here (the instance API, and every blob of every SQLite
table decompressed) and read through the UI's own GraphQL schema, served by a real code-server process that loads
the code location from the environment as ``dagster dev`` does. A resource value bound from ``os.environ`` when the
definitions load is a default in every job snapshot; a URL with a password is bound by its variable's name
(``dg.EnvVar``) instead. The draft's ``training_history.json`` is covered by the whole-graph run in
``test_reliability_secrets.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import dagster as dg
import pytest
from dagster._serdes import serialize_value

from eagle3_assets.core.storage import DataLayout
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import child_env, fake_server_pipeline_env, write_jsonl
from support.operations import write_workspace
from support.secrets import leaks, password_forms, sqlite_texts, with_password

# Each fragment is unique, so a password cut at its comma or "@" (an error naming a piece of it) is caught too.
PASSWORD = "left7c1e,mid4a2f@right9b3d"
WRONG_PASSWORD = "wrong5e0a,bad8f1c@nope2d7b"  # the server refuses it
ENCODED_PASSWORD = "enc3b9e@comma6f2a,end0c4d"  # written percent-encoded (%40, %2C) into its URL
API_KEY = "sk-safety-key-91d3e7"
USER = "alice"
NEEDLES = [*(form for pw in (PASSWORD, WRONG_PASSWORD, ENCODED_PASSWORD) for form in password_forms(USER, pw)), API_KEY]


def _leaks(where: str, text: str) -> list[str]:
    return leaks(where, text, NEEDLES)


def _with_password(base_url: str, password: str) -> str:
    return with_password(base_url, USER, password)


def _resource_defaults(snapshot: object) -> dict[str, object]:
    """The configured values of every resource in a job snapshot (Dagster stores them as config defaults)."""
    defaults: dict[str, object] = {}
    for config_type in snapshot.config_schema_snapshot.all_config_snaps_by_key.values():  # type: ignore[attr-defined]
        for field in config_type.fields or []:
            if field.default_provided and field.default_value_as_json_str:
                value = json.loads(field.default_value_as_json_str)
                if isinstance(value, dict):
                    defaults.update(value)
    return defaults


GRAPHQL_RESOURCES = """
query ($repo: RepositorySelector!) {
  allTopLevelResourceDetailsOrError(repositorySelector: $repo) {
    __typename
    ... on ResourceDetailsList { results { name configuredValues { key value type } } }
  }
}"""
GRAPHQL_LAUNCHPAD = """
query ($job: PipelineSelector!) {
  runConfigSchemaOrError(selector: $job) { __typename ... on RunConfigSchema { rootDefaultYaml } }
}"""
GRAPHQL_RUNS = """
query {
  runsOrError { ... on Runs { results { runId status runConfigYaml tags { key value } } } }
}"""
GRAPHQL_LOGS = """
query ($runId: ID!) {
  logsForRun(runId: $runId) {
    __typename
    ... on EventConnection {
      events {
        __typename
        ... on MessageEvent { message }
        ... on ExecutionStepFailureEvent { error { message stack causes { message stack } } }
        ... on RunFailureEvent { pipelineFailureError: error { message stack } }
        ... on EngineEvent { error { message stack } }
        ... on MaterializationEvent {
          metadataEntries {
            label
            ... on TextMetadataEntry { text }
            ... on JsonMetadataEntry { jsonString }
            ... on MarkdownMetadataEntry { mdStr }
            ... on PathMetadataEntry { path }
            ... on UrlMetadataEntry { url }
          }
        }
      }
    }
  }
}"""


def _ui_texts(tmp_path: Path, instance: dg.DagsterInstance, run_ids: list[str]) -> dict[str, str]:
    """What the UI reads, through its GraphQL schema, from a code server loading the code location as `dagster dev`
    does (a separate process, from this process's environment)."""
    from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql

    workspace = write_workspace(tmp_path)
    repo = {"repositoryLocationName": "eagle3_assets", "repositoryName": "__repository__"}
    texts: dict[str, str] = {}
    with define_out_of_process_context(str(workspace), None, instance) as context:

        def query(name: str, text: str, variables: dict | None = None) -> dict:
            result = execute_dagster_graphql(context, text, variables)
            assert not result.errors, (name, result.errors)
            texts[name] = json.dumps(result.data)
            return result.data

        resources = query("resources", GRAPHQL_RESOURCES, {"repo": repo})
        query("launchpad", GRAPHQL_LAUNCHPAD, {"job": {**repo, "pipelineName": "__ASSET_JOB"}})
        query("runs", GRAPHQL_RUNS)
        for run_id in run_ids:
            query(f"logs {run_id}", GRAPHQL_LOGS, {"runId": run_id})
    shown = {
        r["name"]: {v["key"]: (v["type"], v["value"]) for v in r["configuredValues"]}
        for r in resources["allTopLevelResourceDetailsOrError"]["results"]
    }
    # what the Resources page shows: the variable's name where the URL holds a password, the value elsewhere
    assert shown["inference_server"]["base_url"] == ("ENV_VAR", "EAGLE3_VLLM_BASE_URL"), shown["inference_server"]
    assert shown["verifier"]["hidden_states_url"] == ("ENV_VAR", "EAGLE3_HIDDEN_STATES_URL")
    assert shown["evaluation_servers"]["draft_url"] == ("ENV_VAR", "EAGLE3_EVAL_DRAFT_URL")
    assert shown["inference_server"]["concurrency"] == ("VALUE", "4")
    return texts


@pytest.mark.slow  # ~30 s on 2 busy cores, most of it the code server the UI's queries need
def test_url_passwords_and_the_api_key_are_in_nothing_dagster_stores_or_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation through the code location's definitions (resources from the environment) against two real
    servers: one behind basic auth, whose URL carries a password with ``,`` and ``@``, the other behind
    ``EAGLE3_API_KEY``; the extraction and evaluation URLs carry passwords too (one percent-encoded). Then the
    password is changed to one the server refuses. Nothing the instance stored (run config, job and plan
    snapshots, event log, asset metadata, every SQLite cell decoded), nothing the UI serves (GraphQL) and no error
    text holds any spelling of any password or the key; the runs did use them."""
    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.operations.demo import materialize_asset

    home = tmp_path / "dagster_home"
    home.mkdir()
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": f"k{i}", "prompt": f"secret test {i}"} for i in range(8)])
    basic = FakeConfig(token_rate=200, median_tokens=20, basic_auth=f"{USER}:{PASSWORD}")
    keyed = FakeConfig(token_rate=200, median_tokens=20, api_key=API_KEY)
    with FakeServerProcess(basic) as behind_password, FakeServerProcess(keyed) as behind_key:
        urls = f"{_with_password(behind_password.base_url, PASSWORD)},{behind_key.base_url}"
        env = {
            **fake_server_pipeline_env(home, layout, dataset, urls),
            "EAGLE3_API_KEY": API_KEY,
            "EAGLE3_SERVER_TARGET": "1",  # one request at a time on each server: both answer the partition
            # not contacted by these runs, but bound into the resources every job snapshot records
            "EAGLE3_HIDDEN_STATES_URL": _with_password("http://127.0.0.1:9/v1", quote(ENCODED_PASSWORD, safe="")),
            "EAGLE3_EVAL_DRAFT_URL": _with_password("http://127.0.0.1:9/v1", PASSWORD),
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        defs = build_definitions()  # as the code location loads them
        with dg.DagsterInstance.get() as instance:
            assert Path(instance.root_directory) == home
            assert materialize_asset(defs, instance, "raw_prompts", raise_on_error=False).success
            done = materialize_asset(defs, instance, "synthetic_responses", "00000", raise_on_error=False)
            errors = [e.event_specific_data.error.to_string() for e in done.get_step_failure_events()]
            assert done.success, "\n".join(errors)
            assert done.asset_materializations_for_node("synthetic_responses")[0].metadata["ok"].value == 4
            # both servers answered: the password and the key were sent (the first URL is the basic-auth one)
            assert behind_password.stats()["requests"] and behind_key.stats()["requests"]

            # a password the server refuses, read when the run starts (the definitions hold only the name)
            monkeypatch.setenv("EAGLE3_VLLM_BASE_URL", _with_password(behind_password.base_url, WRONG_PASSWORD))
            refused = materialize_asset(defs, instance, "synthetic_responses", "00001", raise_on_error=False)
            assert not refused.success
            refusal = refused.get_step_failure_events()[0].event_specific_data.error.to_string()
            assert "401" in refusal and behind_password.base_url in refusal, refusal  # names the server, not the pw

            texts: dict[str, str] = {"refusal": refusal}
            runs = instance.get_runs()
            assert len(runs) == 3
            for run in runs:
                stored = instance.get_run_by_id(run.run_id)
                assert stored is not None
                texts[f"run {run.run_id}"] = serialize_value(stored)
                texts[f"run config {run.run_id}"] = json.dumps(stored.run_config)
                snapshot = instance.get_job_snapshot(stored.job_snapshot_id)
                texts[f"job snapshot {run.run_id}"] = serialize_value(snapshot)
                plan = instance.get_execution_plan_snapshot(stored.execution_plan_snapshot_id)
                texts[f"plan snapshot {run.run_id}"] = serialize_value(plan)
                texts[f"event log {run.run_id}"] = "\n".join(serialize_value(r) for r in instance.all_logs(run.run_id))
                defaults = _resource_defaults(snapshot)
                # the snapshot was decoded: the resources' values are there, the URLs by their variables' names
                assert defaults["concurrency"] == 4 and defaults["base_url"] == {"env": "EAGLE3_VLLM_BASE_URL"}
                assert defaults["hidden_states_url"] == {"env": "EAGLE3_HIDDEN_STATES_URL"}
            texts.update(_ui_texts(tmp_path, instance, [run.run_id for run in runs]))
    assert any("synthetic_responses 00000 finished" in text for text in texts.values())  # the log was read
    cells = list(sqlite_texts(home))
    assert any("EAGLE3_VLLM_BASE_URL" in text for where, text in cells if where.endswith(":snapshots"))
    leaks = [leak for where, text in [*texts.items(), *cells] for leak in _leaks(where, text)]
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".db")]
    leaks += [leak for path in files for leak in _leaks(str(path), path.read_bytes().decode("utf-8", "replace"))]
    assert not leaks, "\n".join(leaks)


def _eagle3(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "eagle3_assets.cli", *args]
    return subprocess.run(command, env=child_env(**env), cwd=cwd, capture_output=True, text=True, timeout=120)


def test_eagle3_config_masks_url_passwords_and_the_key(tmp_path: Path) -> None:
    """`eagle3 config` (what an operator pastes into a bug report) shows each server's host, never a password or
    the key, whatever the password holds; a URL that is wrong is named in its error without its password."""
    env = {
        "EAGLE3_VLLM_BASE_URL": f"http://{USER}:{PASSWORD}@gpu-a:8000/v1,http://gpu-b:8000/v1",
        "EAGLE3_EVAL_DRAFT_URL": f"http://{USER}:{quote(ENCODED_PASSWORD, safe='')}@draft:8000/v1",
        # a password with a "/" must be percent-encoded: this URL is wrong, and its error must not repeat it
        "EAGLE3_EVAL_PLAIN_URL": f"http://{USER}:{WRONG_PASSWORD}/x@plain:8000/v1",
        "EAGLE3_API_KEY": API_KEY,
        "EAGLE3_DATA_DIR": str(tmp_path / "data"),
    }
    done = _eagle3(["config"], env, tmp_path)
    assert done.returncode == 1, done.stderr  # the wrong URL
    lines = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert lines["EAGLE3_VLLM_BASE_URL"] == "http://***@gpu-a:8000/v1,http://gpu-b:8000/v1"
    assert lines["EAGLE3_EVAL_DRAFT_URL"] == "http://***@draft:8000/v1"
    assert lines["EAGLE3_EVAL_PLAIN_URL"] == (
        "ERROR EAGLE3_EVAL_PLAIN_URL='http://***@plain:8000/v1': 'http://***@plain:8000/v1': a password holding '/', "
        "'?' or '#' must be percent-encoded (%2F, %3F, %23)"
    )
    assert lines["EAGLE3_API_KEY"] == "***"
    leaks = _leaks("eagle3 config", done.stdout + done.stderr)
    assert not leaks, "\n".join(leaks)


def test_a_refused_url_names_its_variable_and_not_its_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong URL holding a password fails the run that uses it when it starts (the code location still loads),
    naming the variable; no spelling of the password is in the error, in the event log or in any SQLite cell."""
    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.operations.demo import materialize_asset

    home = tmp_path / "dagster_home"
    home.mkdir()
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": "k0", "prompt": "a question"}])
    # unencoded "/" and "#" in the password: not a URL any client can use
    wrong_url = f"http://{USER}:{PASSWORD}/x#y@127.0.0.1:9/v1,http://127.0.0.1:8/v1"
    for key, value in fake_server_pipeline_env(home, layout, dataset, wrong_url).items():
        monkeypatch.setenv(key, value)
    defs = build_definitions()
    with dg.DagsterInstance.get() as instance:
        assert materialize_asset(defs, instance, "raw_prompts", raise_on_error=False).success
        failed = materialize_asset(defs, instance, "synthetic_responses", "00000", raise_on_error=False)
        assert not failed.success
        (run,) = [r for r in instance.get_runs() if r.run_id == failed.run_id]
        log = "\n".join(serialize_value(r) for r in instance.all_logs(run.run_id))
    assert "EAGLE3_VLLM_BASE_URL='http://***@127.0.0.1:9/v1,http://127.0.0.1:8/v1'" in log
    assert "must be percent-encoded" in log
    leaks = [*_leaks("event log", log), *(leak for where, text in sqlite_texts(home) for leak in _leaks(where, text))]
    assert not leaks, "\n".join(leaks)


def test_redaction_keeps_hosts_and_hides_every_password_spelling() -> None:
    """The one redaction every error and log line goes through, on the shapes that broke it: an ``@`` or ``,`` in
    the password, a list of URLs, an encoded password, and text around them. A comma splits a URL list only before
    the next URL; a list item without its scheme is still refused."""
    from eagle3_assets.core.settings import ConfigError, check_base_urls, redact_url_credentials

    text = (
        f"EAGLE3_VLLM_BASE_URL='http://{USER}:{PASSWORD}@a:1/v1,http://b:2/v1, http://u:{quote(ENCODED_PASSWORD)}@c/v1'"
    )
    assert redact_url_credentials(text) == "EAGLE3_VLLM_BASE_URL='http://***@a:1/v1,http://b:2/v1, http://***@c/v1'"
    urls = check_base_urls("K", f"http://{USER}:{PASSWORD}@a:1/v1,http://b:2/v1")
    assert urls == [f"http://{USER}:{PASSWORD}@a:1/v1", "http://b:2/v1"]  # the comma in the password splits nothing
    with pytest.raises(ConfigError, match="every URL of a comma-separated list needs its http"):
        check_base_urls("K", "http://a:1/v1,b:2/v1")
