"""Online training (``hidden_states_source``): a draft trains from partitions whose state files are gone, its
batches' states computed by the ``hf`` backend in a loader worker process; hybrid mode reads the files that exist;
the batches equal the stored ones within bf16 storage rounding; the run reports its time split."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

KEYS = ["00000", "00001"]
LAYERS = [1, 2, 3]
BASE = TrainConfig(epochs=2, tokens_per_batch=768, lr=3e-3, warmup_ratio=0.0, max_val_batches=2, precision="float32")


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> DataLayout:
    layout = DataLayout.at(tmp_path_factory.mktemp("online") / "data")
    for key in KEYS:
        fabricate_responses(layout, key, 24, min_words=20, max_words=40)
        extract_partition(
            layout, key, cached_tiny_verifier(), HiddenStatesConfig(layer_ids=LAYERS, precision="float32")
        )
    build_vocab_mapping(layout, KEYS[:1], draft_vocab_size=256, target_vocab_size=1024)
    return layout


def _copy(src: DataLayout, dst: Path, keep_files: int | None) -> DataLayout:
    """hidden states + vocab mapping; of each partition's state files keep the first ``keep_files`` (None: all)."""
    for asset in ("hidden_states", "vocab_mapping"):
        shutil.copytree(src.asset_dir(asset), dst / asset, symlinks=True, ignore=shutil.ignore_patterns("_locks"))
    layout = DataLayout.at(dst)
    if keep_files is not None:
        for key in KEYS:
            for path in (layout.hidden_states_dir(key) / "hidden_states").glob("hs_*.safetensors"):
                if int(path.stem.split("_")[1]) >= keep_files:
                    path.unlink()
    return layout


def _state_files(layout: DataLayout) -> int:
    return sum(1 for _ in layout.root.rglob("hs_*.safetensors"))


def test_online_batches_equal_the_stored_ones_within_storage_rounding(stored: DataLayout, tmp_path: Path) -> None:
    import torch

    from eagle3_assets.training.data import make_loader
    from eagle3_assets.training.online_states import OnlineExtraction

    online = OnlineExtraction("online", "hf", str(cached_tiny_verifier()), tuple(LAYERS), device="cpu",
                              precision="float32")  # fmt: skip
    layout = _copy(stored, tmp_path / "data", keep_files=0)
    args = ([layout.hidden_states_dir(KEYS[0])], 512, 64, len(LAYERS), torch.float32, 0)
    in_process = TrainConfig(online_workers=0)
    got = next(iter(make_loader(*args, online=online, config=in_process)))
    ref = next(iter(make_loader([stored.hidden_states_dir(KEYS[0])], *args[1:])))
    assert torch.equal(got["input_ids"], ref["input_ids"]) and got["online_extract_s"] > 0
    for name in ("hidden_states", "verifier_last_hidden_states"):
        scale = float(ref[name].abs().max())
        assert float((got[name] - ref[name]).abs().max()) <= scale / 64, name  # bf16 keeps 8 bits


@pytest.mark.parametrize(("source", "keep_files"), [("online", 0), ("hybrid", 10)])
def test_a_draft_trains_without_stored_states(stored: DataLayout, tmp_path: Path, source: str, keep_files: int) -> None:
    import json

    layout = _copy(stored, tmp_path / "data", keep_files=keep_files)
    before = _state_files(layout)
    config = TrainConfig(**{**BASE.__dict__, "hidden_states_source": source, "online_workers": 1})
    result = train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), config)
    assert result.val_loss[-1] < result.val_loss_untrained, (result.val_loss, result.val_loss_untrained)
    assert _state_files(layout) == before  # nothing written: the states lived in memory only
    split = result.hidden_states
    assert split["source"] == source and split["fetch_s"] > 0 and split["train_s"] > 0, split
    history = json.loads((layout.draft_model_dir / "training_history.json").read_text())
    assert history["config"]["hidden_states_source"] == source


def test_stored_mode_names_the_missing_file_and_the_online_setting(stored: DataLayout, tmp_path: Path) -> None:
    layout = _copy(stored, tmp_path / "data", keep_files=0)
    with pytest.raises(Exception, match="hidden_states_source"):
        train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), BASE)


def test_an_online_partition_stores_no_states_and_passes_its_checks(tmp_path: Path) -> None:
    """store_budget_bytes=0: index, dataset, frequencies and lineage, no state file; the checks pass on what is
    stored; a budget keeps the first samples' files (hybrid) and removes the rest; offline evaluation says why it
    cannot read an online partition."""
    import polars as pl

    from eagle3_assets.evaluation.offline import iter_samples
    from eagle3_assets.hidden_states import check_finite, check_one_per_ok_response, check_token_ids

    layout = DataLayout.at(tmp_path / "data")
    fabricate_responses(layout, KEYS[0], 12, min_words=20, max_words=40)
    verifier = cached_tiny_verifier()
    online = extract_partition(layout, KEYS[0], verifier, HiddenStatesConfig(layer_ids=LAYERS, store_budget_bytes=0))
    assert online.samples == 12 and online.samples_with_states == 0 and online.bytes == 0
    assert _state_files(layout) == 0
    index = pl.read_parquet(layout.hidden_states_index_path(KEYS[0]))
    assert index.height == 12 and index["file"].null_count() == 12
    for check in (check_token_ids, check_finite, check_one_per_ok_response):
        assert check(layout, KEYS[0]).passed, check.__name__
    with pytest.raises(ValueError, match="stores no states"):
        next(iter_samples(layout, KEYS[0]))

    full = extract_partition(layout, KEYS[0], verifier, HiddenStatesConfig(layer_ids=LAYERS))
    assert full.samples_with_states == 12 and _state_files(layout) == 12
    per_sample = full.bytes // 12
    hybrid = extract_partition(
        layout, KEYS[0], verifier, HiddenStatesConfig(layer_ids=LAYERS, store_budget_bytes=5 * per_sample)
    )
    assert 0 < hybrid.samples_with_states < 12 and hybrid.stored == 0  # kept files reused, none recomputed
    assert len(list(layout.hidden_states_dir(KEYS[0]).glob("hidden_states/hs_*"))) == hybrid.samples_with_states
    assert check_one_per_ok_response(layout, KEYS[0]).passed


@pytest.mark.slow
def test_sigkill_of_online_training_leaves_no_worker_and_resumes(stored: DataLayout, tmp_path: Path) -> None:
    """A SIGKILLed online run: its loader worker (the process computing states) goes with it, and the next run
    resumes from the last checkpoint, online again."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    layout = _copy(stored, tmp_path / "data", keep_files=0)
    fields = {**BASE.__dict__, "epochs": 4, "hidden_states_source": "online", "online_workers": 1}
    script = textwrap.dedent(
        f"""
        from eagle3_assets.core.storage import DataLayout
        from eagle3_assets.training import TrainConfig, train_draft
        train_draft(DataLayout.at({str(layout.root)!r}), {KEYS[:1]!r}, {KEYS[1]!r}, {str(cached_tiny_verifier())!r},
                    TrainConfig(**{fields!r}))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    ckpt_dir = layout.draft_model_dir / "checkpoints"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None and not (ckpt_dir / "epoch_0001.pt").exists():
            time.sleep(0.05)
        assert proc.poll() is None, "training ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()

    def children() -> list[str]:  # processes whose parent was the killed run (the spawned loader worker)
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields_ = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields_[1]) == proc.pid:
                found.append(stat.parent.name)
        return found

    stop = time.monotonic() + 30
    while children() and time.monotonic() < stop:
        time.sleep(0.2)
    assert children() == []
    last = max(int(p.stem.split("_")[1]) for p in ckpt_dir.glob("epoch_*.pt"))
    result = train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), TrainConfig(**fields))
    assert result.resumed_from_epoch == last and result.epochs == 4
    assert _state_files(layout) == 0


def test_online_training_against_a_dead_extraction_server_fails_naming_it(stored: DataLayout, tmp_path: Path) -> None:
    from support.reliability import free_port

    layout = _copy(stored, tmp_path / "data", keep_files=0)
    url = f"http://127.0.0.1:{free_port()}/v1"
    config = TrainConfig(
        **{**BASE.__dict__, "hidden_states_source": "online", "online_backend": "vllm", "online_urls": (url,),
           "online_storage": str(tmp_path / "transfer"), "online_workers": 0},
    )  # fmt: skip
    (tmp_path / "transfer").mkdir()
    with pytest.raises(Exception, match=r"127\.0\.0\.1"):
        train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), config)


@pytest.mark.parametrize("lie", ["wrong_ids", "garbage"])
def test_a_lying_extraction_server_fails_the_run_and_a_rerun_resumes_from_the_last_checkpoint(
    stored: DataLayout, tmp_path: Path, lie: str
) -> None:
    """Mid-run the extraction server starts lying (states for other token ids, or a file that is not safetensors):
    the run stops naming the server and what it sent, no checkpoint past the last honest epoch is written and the
    published draft is the one before; the next run resumes from that checkpoint."""
    from support.fake_extraction import ExtractionFake, serve_extraction

    layout = _copy(stored, tmp_path / "data", keep_files=0)
    online = {**BASE.__dict__, "hidden_states_source": "online", "online_workers": 0}
    first = train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), TrainConfig(**{**online, "epochs": 1}))
    ckpt_dir = layout.draft_model_dir / "checkpoints"
    checkpoints = sorted(p.name for p in ckpt_dir.glob("epoch_*.pt"))
    history = (layout.draft_model_dir / "training_history.json").read_bytes()
    assert first.epochs == 1 and checkpoints

    storage = tmp_path / "transfer"
    storage.mkdir()
    with serve_extraction(ExtractionFake(storage, mode=lie)) as url:
        lying = TrainConfig(
            **{**online, "epochs": 3, "online_backend": "vllm", "online_urls": (url,), "online_storage": str(storage)}
        )
        with pytest.raises(Exception) as caught:
            train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), lying)
    text = str(caught.value)
    assert url.removesuffix("/v1").split("//")[1] in text, text
    assert ("token_ids differ" if lie == "wrong_ids" else "not a readable safetensors file") in text, text
    assert sorted(p.name for p in ckpt_dir.glob("epoch_*.pt")) == checkpoints  # nothing trained on the lie was kept
    assert (layout.draft_model_dir / "training_history.json").read_bytes() == history

    resumed = train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), TrainConfig(**{**online, "epochs": 3}))
    assert resumed.resumed_from_epoch == 0 and resumed.epochs == 3


def test_online_training_sends_the_extraction_servers_key_and_outage_budget(
    stored: DataLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extraction servers behind EAGLE3_API_KEY answer online training as they answer extraction: the loader's
    client sends the key (read from the environment, never saved with the config) and the outage budget."""
    from support.fake_extraction import ExtractionFake, serve_extraction

    layout = _copy(stored, tmp_path / "data", keep_files=0)
    storage = tmp_path / "transfer"
    storage.mkdir()
    monkeypatch.setenv("EAGLE3_API_KEY", "s3cret")
    fake = ExtractionFake(storage, api_key="s3cret")
    with serve_extraction(fake) as url:
        config = TrainConfig(
            **{**BASE.__dict__, "epochs": 1, "hidden_states_source": "online", "online_backend": "vllm",
               "online_urls": (url,), "online_storage": str(storage), "online_workers": 1,
               "online_outage_budget_s": 7.0},
        )  # fmt: skip
        result = train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), config)
    assert result.epochs == 1 and fake.requests >= 24  # every training and validation sample fetched
    assert "s3cret" not in (layout.draft_model_dir / "training_history.json").read_text()
    from eagle3_assets.training.online_states import online_extraction

    options = online_extraction(config, cached_tiny_verifier(), {"max_seq_len": 64, "layer_ids": LAYERS}).vllm
    assert (options.api_key, options.outage_budget_s) == ("s3cret", 7.0)


def test_the_offline_evaluation_computes_the_states_an_online_held_out_partition_does_not_store(
    tmp_path: Path,
) -> None:
    """draft_evaluation after online training: the held-out partition stores no states, so the offline simulation
    gets them from the extraction side: the same samples, their states those the stored partition held."""
    import torch

    from eagle3_assets.evaluation.evaluate import EvaluationOptions, run_evaluation
    from eagle3_assets.evaluation.offline import iter_samples
    from eagle3_assets.hidden_states.state_checks import read_meta
    from eagle3_assets.training.online_states import extraction_side, fetching, for_partition

    layout = DataLayout.at(tmp_path / "data")
    verifier = cached_tiny_verifier()
    for key in KEYS:
        fabricate_responses(layout, key, 24, min_words=20, max_words=40)
        extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=LAYERS, precision="float32"))
    build_vocab_mapping(layout, KEYS[:1], draft_vocab_size=256, target_vocab_size=1024)
    train_draft(layout, KEYS[:1], KEYS[1], verifier, BASE)
    draft = layout.draft_model_dir / "final"
    options = EvaluationOptions(online=False, untrained=False, partition=KEYS[1], device="cpu")
    stored = run_evaluation(layout, draft, verifier, options, write=False).stats[0]
    stored_states = {sid: states for sid, _ids, _mask, states in iter_samples(layout, KEYS[1])}

    online_config = HiddenStatesConfig(layer_ids=LAYERS, precision="float32", store_budget_bytes=0)
    assert extract_partition(layout, KEYS[1], verifier, online_config).samples_with_states == 0
    with pytest.raises(ValueError, match="stores no states"):
        run_evaluation(layout, draft, verifier, options, write=False)
    side = extraction_side("hf", "", device="cpu", precision="float32")
    report = run_evaluation(layout, draft, verifier, replace(options, extraction=side), write=False)
    assert report.stats[0].extra["samples"] == stored.extra["samples"] > 0
    assert any("24 of 24 held-out samples' states computed by the hf backend" in n for n in report.notes), report.notes
    assert _state_files(layout) == 24  # the training partition's; nothing was written for the held-out one

    aimed = for_partition(replace(side, verifier_path=str(verifier)), read_meta(layout, KEYS[1]))
    with fetching(aimed, tmp_path / "transfer") as fetch:
        fetched = {sid: states for sid, _ids, _mask, states in iter_samples(layout, KEYS[1], fetch=fetch)}
    assert fetched.keys() == stored_states.keys()
    for sid, states in fetched.items():  # stored states went through bf16 storage; fetched ones did not
        torch.testing.assert_close(states.float(), stored_states[sid].float(), rtol=1e-2, atol=1e-2)


def test_the_embedded_extraction_server_dying_mid_run_stops_it_within_seconds(
    stored: DataLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's embedded extraction server (here the fake, a real subprocess) is killed after the first epoch: the
    loader worker, which only knows its URL, sees it gone and the run stops naming it, instead of retrying for the
    outage budget; the checkpoint of the finished epoch stays for the next run."""
    import signal
    import threading
    import time

    from eagle3_assets.local import extraction_server as local_extraction
    from support.fake_extraction import ExtractionServerProcess

    servers: list[ExtractionServerProcess] = []

    def start(verifier: Path, layer_ids: list[int], path: Path, **kwargs: object) -> ExtractionServerProcess:
        path.mkdir(parents=True, exist_ok=True)
        servers.append(ExtractionServerProcess(path, tmp_path / "fake-server.log"))
        return servers[-1]

    monkeypatch.setattr(local_extraction, "start_extraction_server", start)
    layout = _copy(stored, tmp_path / "data", keep_files=0)
    ckpt_dir = layout.draft_model_dir / "checkpoints"
    killed: list[float] = []

    def kill_after_first_epoch() -> None:
        while not (ckpt_dir / "epoch_0000.pt").exists():
            time.sleep(0.02)
        servers[0].process.send_signal(signal.SIGKILL)
        killed.append(time.monotonic())

    threading.Thread(target=kill_after_first_epoch, daemon=True).start()
    config = TrainConfig(
        **{**BASE.__dict__, "epochs": 8, "hidden_states_source": "online", "online_backend": "vllm",
           "online_workers": 1},
    )  # fmt: skip
    with pytest.raises(Exception, match=r"embedded extraction server \(pid \d+\) is gone") as caught:
        train_draft(layout, KEYS[:1], KEYS[1], cached_tiny_verifier(), config)
    assert killed and time.monotonic() - killed[0] < 60, "the run waited for the outage budget (900 s)"
    assert "fake-server.log" in str(caught.value)
    assert (ckpt_dir / "epoch_0000.pt").exists() and not (ckpt_dir / "epoch_0007.pt").exists()


def test_the_embedded_server_stop_removes_what_aborted_requests_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An aborted request (the client retried after a timeout, a loader worker stopped mid-batch) leaves the
    connector's ``.lock`` and maybe its file; once the run's embedded server stops they are removed, and nothing
    else in the folder is touched (CI saw a stray ``.safetensors.lock`` after an online run)."""
    from eagle3_assets.local import extraction_server as local_extraction
    from eagle3_assets.training.online_states import online_extraction, serving

    storage = tmp_path / "transfer"

    class AbortingServer:
        base_url = "http://127.0.0.1:1/v1"

        def stop(self) -> None:  # what the connector leaves for an aborted request
            (storage / "eagle3-hs-cmpl-1.safetensors.lock").write_bytes(b"")
            (storage / "eagle3-hs-cmpl-2.safetensors").write_bytes(b"x")
            (storage / "eagle3-hs-cmpl-2.safetensors.lock").write_bytes(b"")

    def start(verifier: Path, layer_ids: list[int], path: Path, **kwargs: object) -> AbortingServer:
        path.mkdir(parents=True)
        (path / "notes.txt").write_text("not the connector's")
        return AbortingServer()

    monkeypatch.setattr(local_extraction, "start_extraction_server", start)
    config = TrainConfig(hidden_states_source="online", online_backend="vllm")
    extraction = online_extraction(config, tmp_path, {"max_seq_len": 64, "layer_ids": LAYERS})
    with serving(extraction, storage) as served:
        assert served.vllm.urls == (AbortingServer.base_url,)
    assert sorted(p.name for p in storage.iterdir()) == ["notes.txt"]


def test_each_training_rank_has_its_own_transfer_folder_and_its_stop_spares_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several torchrun ranks, each with its own embedded extraction server: a rank that stops first sweeps only its
    own folder, never a connector file another rank's server just wrote for a batch still being read."""
    from eagle3_assets.local import extraction_server as local_extraction
    from eagle3_assets.training.online_states import online_extraction, serving, transfer_dir
    from eagle3_assets.training.ranks import Ranks

    class StubServer:
        base_url = "http://127.0.0.1:1/v1"

        def stop(self) -> None:
            pass

    def start(verifier: Path, layer_ids: list[int], path: Path, **kwargs: object) -> StubServer:
        path.mkdir(parents=True, exist_ok=True)
        return StubServer()

    monkeypatch.setattr(local_extraction, "start_extraction_server", start)
    folders = [transfer_dir(tmp_path, Ranks(rank, 2)) for rank in (0, 1)]
    assert folders[0] != folders[1] and transfer_dir(tmp_path, Ranks(0, 1)).name == ".online-transfer"
    config = TrainConfig(hidden_states_source="online", online_backend="vllm")
    extraction = online_extraction(config, tmp_path, {"max_seq_len": 64, "layer_ids": LAYERS})
    folders[1].mkdir(parents=True)
    in_flight = folders[1] / "eagle3-hs-cmpl-7.safetensors"
    in_flight.write_bytes(b"rank 1's batch")
    with serving(extraction, folders[0]):
        (folders[0] / "eagle3-hs-cmpl-1.safetensors.lock").write_bytes(b"")
    assert in_flight.exists() and list(folders[0].iterdir()) == []
