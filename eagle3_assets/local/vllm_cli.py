"""``eagle3 serve-local`` (``python -m eagle3_assets.local.vllm_cli``): serve / start / stop / status.

* ``serve --model DIR [--port P]``   foreground; Ctrl-C or SIGTERM stops the server;
* ``start --model DIR [--port P] [--pid-file F]``  detached; returns once ``/v1/models`` answers 200;
* ``stop [--port P | --pid-file F]``  stops what ``start`` started;
* ``status [--port P]``  exit 0 when a server answers on that port.

``--hidden-states`` (serve/start) runs the verifier in hidden-states extraction mode (the ``vllm`` hidden-states
backend's server): ``--layer-ids`` and ``--storage`` say which layers and where the connector writes its files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_assets.core import process_guard
from eagle3_assets.core.settings import parse_layer_ids
from eagle3_assets.core.verifier import resolve_layer_ids, verifier_shape
from eagle3_assets.local.extraction_server import extraction_server_config
from eagle3_assets.local.process_group import SIGINT_WAIT_S, STOP_BUDGET_S, stop_process_group
from eagle3_assets.local.vllm_probe import API_KEY_ENV, probe_models, unauthorized_message
from eagle3_assets.local.vllm_server import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_STARTUP_TIMEOUT_S,
    ENV_LOG_DIR,
    ENV_PYTHON,
    LocalVLLMServer,
    VLLMServerConfig,
    VLLMServerError,
    default_log_dir,
)


def _pid_file(args: argparse.Namespace) -> Path:
    if args.pid_file is not None:
        return Path(args.pid_file)
    log_dir = Path(args.log_dir) if args.log_dir is not None else default_log_dir()
    return log_dir / f"vllm-{args.port}.pid"


def _config_from_args(args: argparse.Namespace) -> VLLMServerConfig:
    if args.hidden_states:
        return _extraction_config_from_args(args)
    extra = list(args.extra_arg or [])
    return VLLMServerConfig(
        model=Path(args.model),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        python=Path(args.python) if args.python else None,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        reasoning_parser=args.reasoning_parser,
        enforce_eager=not args.no_enforce_eager,
        speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
        extra_args=extra,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        startup_timeout_s=args.startup_timeout,
        reuse_existing=args.reuse,
    )


def _extraction_config_from_args(args: argparse.Namespace) -> VLLMServerConfig:
    """``--hidden-states``: the verifier in extraction mode (the ``vllm`` hidden-states backend's server)."""
    if args.speculative_config:
        raise SystemExit("error: --hidden-states sets its own --speculative-config; drop one of the two")
    shape = verifier_shape(args.model)
    layer_ids = resolve_layer_ids(parse_layer_ids("--layer-ids", args.layer_ids), shape.num_layers, "--layer-ids")
    log_dir = Path(args.log_dir) if args.log_dir else default_log_dir()
    if not args.storage:  # the default transfer folder lies in the log folder: check it before creating anything
        try:
            process_guard.private_dir(log_dir)
        except process_guard.UnsafePathError as error:
            raise SystemExit(f"error: {error}") from None
    storage = Path(args.storage) if args.storage else log_dir / f"hidden-states-{args.port}"
    config = extraction_server_config(
        Path(args.model),
        layer_ids,
        storage,
        served_model_name=args.served_model_name,
        port=args.port,
        max_model_len=args.max_model_len,
        startup_timeout_s=args.startup_timeout,
        log_dir=log_dir,
        python=Path(args.python) if args.python else None,
        kv_cache_gib=args.kv_cache_gib,
    )
    storage.mkdir(parents=True, exist_ok=True)
    print(f"hidden-states extraction: layer ids {layer_ids} + {shape.num_layers}, files under {storage}", flush=True)
    return dataclasses.replace(
        config,
        host=args.host,
        kv_cache_gib=args.kv_cache_gib,
        enforce_eager=not args.no_enforce_eager,
        extra_args=[*config.extra_args, *(args.extra_arg or [])],
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
    record = {"pid": server.process.pid, "base_url": server.base_url, "model": server.model_name}
    record["log"] = str(server.log_path)
    try:  # never through a link planted where the pid file goes
        pid_fd = process_guard.open_private_file(pid_file.parent, pid_file.name)
    except process_guard.UnsafePathError as error:
        server.stop()
        print(f"error: {error}", file=sys.stderr)
        return 1
    with open(pid_fd, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
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
    except OSError:  # gone, or another user's: not ours to stop
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
    models, status = probe_models(base_url, 5.0, api_key)
    if status == 401:
        print(unauthorized_message(base_url, api_key))
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
        p.add_argument("--log-dir", type=Path, default=None, help=f"default ${ENV_LOG_DIR} or $TMPDIR/eagle3-vllm-UID")

    def server_opts(p: argparse.ArgumentParser) -> None:
        common(p)
        p.add_argument("--model", required=True, type=Path, help="model directory (e.g. from `eagle3 tiny-model`)")
        p.add_argument("--served-model-name", default=None, help="default: the model directory's name")
        p.add_argument("--python", default=None, help=f"vLLM interpreter (default ${ENV_PYTHON} or .venv-vllm)")
        p.add_argument("--max-model-len", type=int, default=1024, help="context length (default: %(default)s)")
        p.add_argument("--kv-cache-gib", type=int, default=1, help="CPU KV cache, GiB (default: %(default)s)")
        p.add_argument(
            "--reasoning-parser",
            default="auto",
            help="vLLM reasoning parser; 'auto' (default): deepseek_r1 when the tokenizer has <think> and </think>, "
            "else none; 'none' to disable",
        )
        p.add_argument("--no-enforce-eager", action="store_true", help="allow torch.compile (slower start-up)")
        p.add_argument("--speculative-config", default=None, help="JSON passed to vLLM --speculative-config")
        p.add_argument(
            "--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S, help="seconds (default: %(default)s)"
        )
        p.add_argument("--reuse", action="store_true", help="reuse a healthy server already on the port")
        p.add_argument(
            "--extra-arg", action="append", help="extra vLLM argument, repeatable (--extra-arg=--max-num-seqs=64)"
        )
        p.add_argument(
            "--hidden-states",
            action="store_true",
            help="serve the model in hidden-states extraction mode (the vllm hidden-states backend's server)",
        )
        p.add_argument("--layer-ids", default="", help="--hidden-states: aux layer ids, e.g. 1,2,3 (default EAGLE-3's)")
        p.add_argument("--storage", default=None, help="--hidden-states: where the connector writes its files")

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
    stop.add_argument(
        "--grace",
        type=float,
        default=SIGINT_WAIT_S,
        help=f"seconds to wait after SIGINT before SIGTERM (at most {SIGINT_WAIT_S:g}: the whole stop takes at most "
        f"{STOP_BUDGET_S:g} s)",
    )
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
