"""draft_evaluation without vLLM: the acceptance bookkeeping, the offline simulation on a stored partition (an
oracle draft reaches k+1, an untrained one ~1), the untrained twin, the report files and the /metrics deltas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.evaluation.evaluation_report import AcceptanceStats, EvaluationReport, OnlineRun, write_report

K = 3


# ------------------------------------------------------------------------------------ pure bookkeeping


def test_anchor_acceptance_counts_the_matching_prefix() -> None:
    import torch

    from eagle3_assets.evaluation.offline import anchor_acceptance, walk

    x = torch.arange(10, 22)  # 12 tokens
    t = int(x.shape[0])
    greedy = torch.cat([x[1:], torch.tensor([0])])  # stored tokens are the verifier's greedy continuation
    mask = torch.zeros(t, dtype=torch.long)
    mask[4:] = 1  # tokens 4.. are assistant tokens
    perfect = torch.tensor([x[2 + j :].tolist() + [0] * (1 + j) for j in range(K)])
    assert perfect.shape == (K, t - 1)
    accepted = anchor_acceptance(perfect, greedy, x, mask)
    # anchors c=3.. (token c+1 is the first assistant token) with a whole window inside the sequence
    assert accepted[:3] == [-1, -1, -1]
    assert all(a == K for a in accepted[3 : t - 1 - K])
    assert all(a == -1 for a in accepted[t - 1 - K :])
    # vLLM's decode walk: one draft per k+1 tokens
    assert walk(accepted, mask.tolist(), K) == [K, K]

    wrong_second = perfect.clone()
    wrong_second[1] = -1  # position 2 never matches: prefix stops at 1 even though position 3 matches
    assert set(a for a in anchor_acceptance(wrong_second, greedy, x, mask) if a >= 0) == {1}

    # a stored token that is not the verifier's greedy choice takes every window containing it out
    greedy2 = greedy.clone()
    greedy2[7] = 999
    acc2 = anchor_acceptance(perfect, greedy2, x, mask)
    assert all(acc2[c] == -1 for c in range(4, 8)) and acc2[3] == K


def _stats(draft: str, mode: str, drafts: int, accepted_per_position: list[int], **extra: Any) -> AcceptanceStats:
    """Stats of ``drafts`` K-token drafts: the draft and accepted token counts follow from them."""
    return AcceptanceStats(
        draft,
        mode,
        K,
        drafts=drafts,
        draft_tokens=drafts * K,
        accepted_tokens=sum(accepted_per_position),
        accepted_per_position=accepted_per_position,
        **extra,
    )


def test_stats_and_report_files(tmp_path: Path) -> None:
    trained = _stats("trained", "online", 10, [8, 5, 2], output_tokens=250, seconds=5.0)
    offline = _stats("trained", "offline", 100, [70, 45, 25])
    untrained = _stats("untrained", "online", 40, [0, 0, 0], output_tokens=250, seconds=20.0)
    humaneval = _stats("trained", "online", 20, [10, 6, 4], output_tokens=100, seconds=1.0, prompt_set="humaneval")
    assert trained.mean_acceptance_length == 2.5
    assert trained.acceptance_rate_per_position == [0.8, 0.5, 0.2]
    report = EvaluationReport(
        draft_dir="d",
        verifier="v",
        k=K,
        held_out_partition="00002",
        stats=[trained, offline, untrained, humaneval],
        online=[
            OnlineRun(
                prompts=4,
                max_tokens=64,
                baseline_output_tokens=250,
                baseline_seconds=10.0,
                mismatches={"trained": [], "untrained": ["s1"]},
                concurrency=4,
                speed_prompts=2,
            ),
            OnlineRun(
                prompts=164,
                max_tokens=64,
                baseline_output_tokens=80,
                baseline_seconds=1.0,
                mismatches={"trained": []},
                prompt_set="humaneval",
                concurrency=64,
                speed_prompts=8,
            ),
        ],
    )
    assert report.speedup("trained") == pytest.approx(2.0)  # the first prompt set measured: held-out
    assert report.speedup("untrained") == pytest.approx(0.5)
    assert report.speedup("trained", "humaneval") == pytest.approx(1.25)
    assert report.agreement("trained") == pytest.approx(2.5 - 2.4)  # online held-out vs offline (held-out samples)
    json_path, md_path = write_report(report, DataLayout.at(tmp_path))
    assert json_path.parent == DataLayout.at(tmp_path).evaluation_dir
    data = json.loads(json_path.read_text())
    assert data["speedup"]["held-out"]["trained"] == pytest.approx(2.0)
    assert data["speedup"]["humaneval"]["trained"] == pytest.approx(1.25)
    assert data["summary"]["humaneval"]["trained (online)"]["mean_acceptance_length"] == 2.0
    assert data["online"]["humaneval"]["prompts"] == 164
    assert data["stats"][0]["mean_acceptance_length"] == 2.5
    md = md_path.read_text()
    assert "| held-out | trained | online | 10 | 2.500 | 0.800 | 0.500 | 0.200 | 50.0 | 2.00 |" in md
    assert "| humaneval | none (plain verifier) | online | - | 1.000 | - | - | - | 80.0 | 1.00 |" in md
    assert "| humaneval | trained | online | 20 | 2.000 | 0.500 | 0.300 | 0.200 | 100.0 | 1.25 |" in md
    assert md.index("| held-out | untrained") < md.index("| humaneval | none")  # grouped by prompt set
    assert "1 DIFFERENT (s1)" in md and "agree" in md
    assert "acceptance over 164 prompts (64 at a time), tok/s at batch 1 on its first 8" in md
    assert not list(json_path.parent.glob(".*tmp*"))  # atomic writes leave nothing behind


def test_acceptance_counts_from_a_per_request_histogram() -> None:
    from eagle3_assets.evaluation.acceptance_counts import acceptance_counts

    # vLLM's metrics.speculative_decoding: 5 verify steps accepted 0, 2 accepted 1, 1 accepted 2, 2 accepted 3
    counts = acceptance_counts({"acceptance_histogram": [5, 2, 1, 2], "num_draft_tokens": 30}, K)
    assert counts == {"drafts": 10, "draft_tokens": 30, "accepted": 10, "per_position": [5, 3, 2]}
    assert sum(counts["per_position"]) == counts["accepted"]
    with pytest.raises(ValueError, match="4 bins"):
        acceptance_counts({"acceptance_histogram": [1, 2, 3, 4], "num_draft_tokens": 3}, 2)


# ------------------------------------------------------------------------------------ offline on stored data


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataLayout, Path]:
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses, record_checks_as_the_assets_do

    verifier = cached_tiny_verifier()
    layout = DataLayout.at(tmp_path_factory.mktemp("eval") / "data")
    fabricate_responses(layout, "00000", 6, min_words=15, max_words=25)
    extract_partition(layout, "00000", verifier, HiddenStatesConfig(layer_ids=[1, 2, 3]))
    record_checks_as_the_assets_do(layout, "00000")
    return layout, verifier


class _OracleDraft:
    """Stands in for a draft whose proposals always equal the stored next tokens (the targets)."""

    def __init__(self, like: object) -> None:
        self.target_layer_ids = [1, 2, 3]
        self.draft_vocab_size = like.draft_vocab_size  # type: ignore[attr-defined]
        self.t2d = like.t2d  # type: ignore[attr-defined]
        self.d2t = like.d2t  # type: ignore[attr-defined]

    def __call__(self, hidden_states, input_ids, document_ids, position_ids, ttt_steps):  # type: ignore[no-untyped-def]
        import torch

        ids = input_ids.squeeze(0)
        return [torch.cat([ids[1 + j :], ids.new_zeros(1 + j)]).unsqueeze(0) for j in range(ttt_steps)]


def test_offline_oracle_reaches_k_plus_one_and_untrained_about_one(
    stored: tuple[DataLayout, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from eagle3_assets.evaluation import offline
    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    layout, verifier = stored
    torch.manual_seed(0)
    untrained = build_draft(verifier, [1, 2, 3], TrainConfig(ttt_steps=K), None).eval()
    # fabricated responses are not the verifier's greedy output: declare the stored tokens greedy, so that every
    # assistant window is simulated and an oracle must be accepted in full
    monkeypatch.setattr(
        offline.VerifierHead, "greedy", lambda self, last: torch.full((last.shape[0],), -1, dtype=torch.long)
    )
    original = offline.anchor_acceptance

    def greedy_is_stored(proposals, greedy, input_ids, loss_mask):  # type: ignore[no-untyped-def]
        return original(proposals, torch.cat([input_ids[1:], input_ids.new_zeros(1)]), input_ids, loss_mask)

    monkeypatch.setattr(offline, "anchor_acceptance", greedy_is_stored)
    stats = {
        s.label: s
        for s in offline.evaluate_offline(
            {"oracle": _OracleDraft(untrained), "untrained": untrained}, layout, "00000", k=K, verifier=verifier
        )
    }
    oracle, rand = stats["oracle"], stats["untrained"]
    assert oracle.drafts > 0 and oracle.extra["coverage"] > 0.5  # all but the last k anchors of each sample
    assert oracle.mean_acceptance_length == pytest.approx(K + 1)
    assert oracle.acceptance_rate_per_position == [1.0] * K
    assert oracle.extra["every_position_mean_acceptance_length"] == pytest.approx(K + 1)
    assert rand.mean_acceptance_length < 1.2, rand.to_dict()
    assert rand.drafts >= oracle.drafts  # the walk drafts more often when less is accepted


def test_offline_real_greedy_and_untrained_twin(stored: tuple[DataLayout, Path], tmp_path: Path) -> None:
    import torch

    from eagle3_assets.evaluation import offline
    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    layout, verifier = stored
    torch.manual_seed(1)
    draft = build_draft(verifier, [1, 2, 3], TrainConfig(ttt_steps=K), None)
    draft.save_pretrained(str(tmp_path / "draft"))
    loaded = offline.load_draft(tmp_path / "draft", verifier)
    assert loaded._attn_impl == "sdpa"
    twin_dir = offline.save_untrained_draft(loaded, tmp_path / "twin")
    twin = offline.load_draft(twin_dir, verifier)
    # same shape, different (seeded) weights; the seed is reproducible
    shapes = {k: v.shape for k, v in loaded.state_dict().items()}
    assert shapes == {k: v.shape for k, v in twin.state_dict().items()}
    again = offline.build_untrained_like(loaded)
    assert torch.equal(again.fc.weight, offline.build_untrained_like(loaded).fc.weight)
    assert not torch.equal(again.fc.weight, loaded.fc.weight)
    # the verifier head's greedy tokens are the full-vocabulary argmax of the model itself
    head = offline.VerifierHead(verifier)
    _sid, ids, _mask, hidden = next(offline.iter_samples(layout, "00000", 1))
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(verifier)).eval()
    with torch.no_grad():
        logits = ref(ids.unsqueeze(0)).logits[0]
    agree = (head.greedy(hidden[:, -1, :]) == logits.argmax(-1)).float().mean()
    assert agree > 0.95  # bf16 storage may flip a near tie
    stats = offline.evaluate_offline({"trained": loaded}, layout, "00000", k=K, verifier=verifier)
    assert stats[0].method == "offline" and 0.0 <= stats[0].extra["coverage"] <= 1.0


def test_cli_offline_only_writes_the_report(
    stored: tuple[DataLayout, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from eagle3_assets.cli.evaluate_command import main
    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    layout, verifier = stored
    torch.manual_seed(2)
    build_draft(verifier, [1, 2, 3], TrainConfig(ttt_steps=K), None).save_pretrained(str(tmp_path / "draft"))
    out = tmp_path / "report"
    argv = ["--draft", str(tmp_path / "draft"), "--verifier", str(verifier), "--data-dir", str(layout.root)]
    argv += ["--offline-only", "--max-samples", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| trained | offline |" in printed and "| untrained | offline |" in printed
    data = json.loads((out / "report.json").read_text())
    assert data["held_out_partition"] == "00000" and data["online"] is None
    assert {(s["label"], s["method"]) for s in data["stats"]} == {("trained", "offline"), ("untrained", "offline")}
    assert not (layout.evaluation_dir / "report.json").exists()  # --out: the asset's report is left alone
    assert main(["--draft", str(tmp_path / "missing"), "--data-dir", str(layout.root), "--offline-only"]) == 1


def test_draft_evaluation_asset_offline(stored: tuple[DataLayout, Path]) -> None:
    import dagster as dg
    import torch

    from eagle3_assets.defs.evaluation import draft_evaluation
    from eagle3_assets.defs.resources import DataStoreResource, EvaluationServersResource, VerifierResource
    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    layout, verifier = stored
    torch.manual_seed(3)
    build_draft(verifier, [1, 2, 3], TrainConfig(ttt_steps=K), None).save_pretrained(
        str(layout.draft_model_dir / "final")
    )
    result = dg.materialize(
        [draft_evaluation],
        resources={
            "data_store": DataStoreResource(data_dir=str(layout.root)),
            "verifier": VerifierResource(path=str(verifier)),
            "evaluation_servers": EvaluationServersResource(),
        },
        run_config={"ops": {"draft_evaluation": {"config": {"online": False, "offline_max_samples": 2}}}},
    )
    assert result.success
    (event,) = result.get_asset_materialization_events()
    metadata = event.materialization.metadata
    assert "offline_trained_mean_acceptance_length" in metadata
    assert "offline_untrained_mean_acceptance_length" in metadata
    rows = [r.data for r in metadata["table"].records]
    assert {(r["draft"], r["method"]) for r in rows} == {("trained", "offline"), ("untrained", "offline")}
    k = metadata["k"].value
    assert all(1.0 <= r["mean_acceptance_length"] <= 1 + k for r in rows if r["drafts"])  # NaN: an empty cell
    assert metadata["dagster/row_count"].value == 2 and "| trained | offline |" in metadata["report_markdown"].value
    assert "data:image/png;base64" in metadata["acceptance_per_position"].value
    assert (layout.evaluation_dir / "report.json").exists() and (layout.evaluation_dir / "report.md").exists()


def test_offline_on_the_cpu_never_compiles_the_draft(
    stored: tuple[DataLayout, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CUDA machine speculators compiles ``Eagle3DraftModel.forward`` at import (``conditional_torch_compile``);
    the offline simulation on the CPU then ran it through the CPU inductor, whose C++ build failed. Here the forward
    is compiled the same way with a backend that fails like that build: the CPU path must never reach it."""
    import torch

    from eagle3_assets.evaluation import offline
    from eagle3_assets.speculators_adapter import eagle3_classes
    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    def failing_backend(graph: object, example_inputs: object) -> object:
        raise RuntimeError("CppCompileError: C++ compile error (injected: the CPU inductor build)")

    cls = eagle3_classes().Eagle3DraftModel
    monkeypatch.setattr(cls, "forward", torch.compile(cls.forward, backend=failing_backend))
    layout, verifier = stored
    torch.manual_seed(4)
    draft = build_draft(verifier, [1, 2, 3], TrainConfig(ttt_steps=K), None).eval()
    stats = offline.evaluate_offline({"trained": draft}, layout, "00000", k=K, verifier=verifier, max_samples=2)
    assert stats[0].extra["samples"] == 2  # the draft ran on every sample; EAGLE3_DEVICE's default, auto: the CPU here
