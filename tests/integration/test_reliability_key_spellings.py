"""Issue 22 (item 5): secrets never reach a command line, a log line, an error or a file.

- every spelling vLLM's argument parser reads as ``--api-key`` (``--api_key``, prefixes such as ``--api-k``,
  ``--api-key=...``) is refused in user-supplied server arguments, without repeating the value; the slow test asks
  vLLM's own parser (the vLLM virtualenv) that each spelling really sets the key;
- credentials inside a base URL (``http://user:pw@host/v1``) become an ``Authorization: Basic`` header: the
  requests, the ``/metrics`` polls and the probes go to the URL without them (a proxy in front of the fake server
  requires the header), and the password appears in no log line, error, row or file.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
from eagle3_assets.local import vllm_server as vs
from fake_vllm import FakeConfig, FakeServerProcess
from support.fake_extraction import ExtractionFake, serve_extraction

SECRET = "sk-spelled-0a1b2c3d4e5f"
PASSWORD = "pw-in-url-9z8y7x6w"
SPELLINGS = [
    ["--api-key", SECRET],
    [f"--api-key={SECRET}"],
    ["--api_key", SECRET],
    [f"--api_key={SECRET}"],
    ["--api-k", SECRET],
    [f"--api-ke={SECRET}"],
    ["--api_k", SECRET],
]
pytestmark = pytest.mark.timeout(120, method="thread")


@pytest.mark.parametrize("extra", SPELLINGS, ids=lambda a: a[0].split("=")[0])
def test_every_spelling_of_the_key_option_is_refused_without_repeating_it(extra: list[str], tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    with pytest.raises(vs.VLLMServerError, match="is refused") as refused:
        vs.VLLMServerConfig(model=tmp_path / "model", extra_args=["--max-num-seqs", "8", *extra])
    assert SECRET not in str(refused.value) and "VLLM_API_KEY" in str(refused.value)


def test_options_that_merely_start_alike_are_not_refused(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    for extra in (["--api-server-count", "2"], ["--enable-auto-tool-choice"], ["--model-impl", "auto"]):
        vs.VLLMServerConfig(model=tmp_path / "model", extra_args=extra)


@pytest.mark.slow
def test_vllms_own_parser_reads_each_refused_spelling_as_the_key() -> None:
    """Why those spellings: vLLM's FlexibleArgumentParser turns them all into api_key (asked in its own venv)."""
    python = vs.default_vllm_python()
    if not python.exists():
        pytest.skip("no vLLM virtualenv (make install-vllm)")
    script = (
        "import sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "p = make_arg_parser(FlexibleArgumentParser())\n"
        "for a in eval(sys.argv[1]):\n"
        "    print('KEY', p.parse_args(['--model', 'x'] + a).api_key)\n"
    )
    done = subprocess.run(
        [str(python), "-c", script, repr(SPELLINGS)], capture_output=True, text=True, timeout=300, check=False
    )
    keys = [line for line in done.stdout.splitlines() if line.startswith("KEY")]
    assert keys == [f"KEY ['{SECRET}']"] * len(SPELLINGS), done.stdout + done.stderr[-2000:]


# ------------------------------------------------------------------------------------ credentials in a URL


def _files_with(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_url_credentials_become_a_header_and_are_never_shown(
    layout: DataLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    notes: list[str] = []
    fake = FakeConfig(token_rate=20000, median_tokens=30, basic_auth=f"alice:{PASSWORD}", max_num_seqs=4)
    prompts = [PromptToGenerate(f"q-{i}", [{"role": "user", "content": f"question {i}"}]) for i in range(8)]
    with FakeServerProcess(fake) as server:
        url = f"http://alice:{PASSWORD}@127.0.0.1:{server.port}/v1"
        # an API key set beside it (for other servers): the URL's own credentials win for that URL (before: aiohttp
        # refused to combine the two and every request failed)
        config = GenerationConfig(base_urls=[url], model="fake-model", concurrency=4, max_tokens=100, api_key=SECRET)
        assert config.base_urls == (f"http://127.0.0.1:{server.port}/v1",) and PASSWORD not in repr(config)
        result = generate_partition(prompts, "00000", layout, config, log=notes.append)
        stats = server.stats()
    assert (result.ok, result.failed) == (8, 0), stats
    assert "401" not in str(stats["outcomes"])
    assert any("reports its load" in n for n in notes), notes  # /metrics was read with the header too
    assert not [n for n in notes if PASSWORD in n]
    assert _files_with(layout.root, PASSWORD.encode()) == []

    wrong = url.replace(PASSWORD, "not-" + PASSWORD)
    with pytest.raises(ConfigError) as caught:  # an error about the URL never repeats its password
        GenerationConfig(base_urls=[wrong, wrong.replace("alice", "bob")], model="fake-model")
    assert PASSWORD not in str(caught.value) and "same server twice" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        GenerationConfig(base_urls=[url, url], model="fake-model")
    assert PASSWORD not in str(caught.value)


def test_an_extraction_url_with_credentials_is_probed_and_used_without_them(tmp_path: Path) -> None:
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackend, VLLMBackendOptions
    from support.hidden_states_data import cached_tiny_verifier

    fake = ExtractionFake(tmp_path, basic_auth=f"alice:{PASSWORD}")
    with serve_extraction(fake) as url:
        with_credentials = url.replace("http://", f"http://alice:{PASSWORD}@")
        # model=None: the backend probes GET /models first (before: urllib misread user:pw@host as a port)
        options = VLLMBackendOptions(urls=(with_credentials,), storage_path=str(tmp_path), concurrency=2)
        backend = VLLMBackend(cached_tiny_verifier(), [1, 2, 3], "float32", options=options, log=lambda _m: None)
        try:
            states = backend.extract([[1, 2, 3], [4, 5, 6, 7]])
        finally:
            backend.close()
    assert [tuple(s.shape) for s in states] == [(3, 4, 64), (4, 4, 64)]
