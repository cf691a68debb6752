"""Dagster's production storage for real (issue 16): the PostgreSQL configuration of docs/scaling.md, against a
PostgreSQL server this test starts itself (Debian's binaries, ``tests/postgres/install.sh``), with a missing-only
backfill of two partitions through ``dagster-daemon``, then ``eagle3 status`` and ``eagle3 sync`` against it."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets import cli
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.net.ports import find_free_port
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import REPO_ROOT
from support.operations import (
    backfill_missing_through_daemon,
    initialize_storage,
    pipeline_env,
    sync_records_what_is_on_disk,
    write_prompts,
    write_workspace,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

INSTALL_HINT = "run tests/postgres/install.sh (apt-get install -y postgresql)"


def _bin_dir() -> Path | None:
    found = shutil.which("postgres")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    return Path(candidates[-1]).parent if candidates else None


def _as_server_user() -> list[str]:
    """PostgreSQL refuses to run as root: as root, run its binaries as the `postgres` system user."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"]


@contextmanager
def postgres_server() -> Iterator[dict[str, str]]:
    """A throwaway PostgreSQL on 127.0.0.1:<free port>, trust auth; yields the DAGSTER_PG_* environment."""
    bin_dir = _bin_dir()
    if bin_dir is None:
        pytest.skip(f"no PostgreSQL server binaries: {INSTALL_HINT}")
    pytest.importorskip("dagster_postgres", reason="dagster-postgres is not installed: make install")
    root = Path(tempfile.mkdtemp(prefix="eagle3-pg-", dir="/tmp"))  # outside root's 0700 pytest folders
    data, port, user = root / "data", find_free_port(), "dagster"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    root.chmod(0o755)
    run = _as_server_user()
    subprocess.run(
        [*run, str(bin_dir / "initdb"), "-D", str(data), "-U", user, "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
    )
    options = f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off"
    pg_ctl = [*run, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log")]
    subprocess.run([*pg_ctl, "-o", options, "-w", "-t", "60", "start"], check=True, capture_output=True)
    try:
        yield {
            "DAGSTER_PG_HOST": "127.0.0.1",
            "DAGSTER_PG_PORT": str(port),
            "DAGSTER_PG_USER": user,
            "DAGSTER_PG_PASSWORD": "",
        }
    finally:
        subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def create_database(env: dict[str, str], name: str) -> None:
    import psycopg2

    connection = psycopg2.connect(
        host=env["DAGSTER_PG_HOST"], port=int(env["DAGSTER_PG_PORT"]), user=env["DAGSTER_PG_USER"], dbname="postgres"
    )
    connection.autocommit = True
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')
    connection.close()


def documented_storage(db_name: str) -> str:
    """The `storage:` block of docs/scaling.md, as written there (only the database name differs per home)."""
    text = (REPO_ROOT / "docs" / "scaling.md").read_text()
    block = re.search(r"```yaml\n(storage:\n  postgres:\n.*?)```", text, re.S)
    assert block, "docs/scaling.md lost its PostgreSQL storage block"
    return block.group(1).replace("db_name: dagster", f"db_name: {db_name}")


def postgres_home(root: Path, db_name: str) -> Path:
    """DAGSTER_HOME = the repo's dagster.yaml (queue, pools, retries, monitoring) + the documented storage."""
    home = root / f"home-{db_name}"
    home.mkdir(parents=True)
    base = (REPO_ROOT / "dagster_home" / "dagster.yaml").read_text()
    (home / "dagster.yaml").write_text(base + "\n" + documented_storage(db_name))
    return home


def test_missing_only_backfill_status_and_sync_on_postgres(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_prompts(tmp_path, 12)
    workspace = write_workspace(tmp_path)
    with postgres_server() as pg, FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=20)) as server:
        for key, value in pg.items():
            monkeypatch.setenv(key, value)
        create_database(pg, "dagster")
        home = postgres_home(tmp_path, "dagster")
        env = {**pipeline_env(layout.root, dataset, 4, server.base_url, home), **pg}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        with dg.DagsterInstance.get() as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
            initialize_storage(instance)
        backfill_missing_through_daemon(workspace, env, layout, dataset, server.base_url, capsys)
        capsys.readouterr()
        assert cli.main(["status"]) == 0
        assert "summary: 3 both" in capsys.readouterr().out

        # A second, empty database as a lost DAGSTER_HOME: `eagle3 sync` records the files into PostgreSQL.
        create_database(pg, "dagster_lost")
        monkeypatch.setenv("DAGSTER_HOME", str(postgres_home(tmp_path, "dagster_lost")))
        sync_records_what_is_on_disk(capsys)
