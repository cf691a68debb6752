"""Offline acceptance: vLLM's greedy EAGLE-3 decode simulated from the stored hidden states of a partition.

For every sample the draft runs speculators' own ``Eagle3DraftModel.forward`` (its TTT rollout, k steps, no loss):
step 0 consumes the verifier's aux hidden states of the context and the next token, steps 1..k-1 its own hidden
states, attending to the context's step-0 keys and its own earlier steps at the same anchor: exactly the KV cache
vLLM's EAGLE-3 proposer has. speculators feeds the *stored* next tokens into steps >= 1 (teacher forcing); that
changes nothing here, because a proposal at step j only counts when proposals 0..j-1 matched, i.e. when they *were*
the stored tokens.

Proposals (draft vocabulary, mapped to target ids with d2t) are compared with the verifier's own greedy next
tokens, ``argmax(lm_head(norm(last hidden state)))`` over the *full* target vocabulary (the verifier's weights, not
the draft's pruned head). An anchor is simulated only where the stored tokens are the verifier's greedy
continuation for the whole window (the first token and the k targets), and all of them are assistant tokens: there
the stored context is exactly what vLLM's greedy decode would have, so the simulation is exact. The share of
anchors that qualify is reported (``coverage``): with temperature-0 responses it is high; with sampled ones the
figure covers the greedy-consistent part only.

Two weightings are reported, both with vLLM's definitions (see report.py):

* ``walk`` (the headline, ``AcceptanceStats``): the decode trajectory vLLM follows, one draft at the first
  assistant position, then the next draft after the accepted tokens and the bonus token (anchor += accepted + 1);
* ``every position``: one draft at every qualifying anchor (in ``extra``), which has no trajectory weighting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.storage import DataLayout, remove_dead_writers_temps, replace_dir_atomic
from eagle3_assets.core.verifier import SPECULATIVE_TOKENS
from eagle3_assets.evaluation.evaluation_report import AcceptanceStats
from eagle3_assets.speculators_adapter import eagle3_classes, load_model_layers

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
# token id lists -> their states [T, n_aux+1, H]: the extraction side, for samples a partition does not store
StatesFetch = Callable[[list[list[int]]], list[Any]]

UNTRAINED_SEED = 0


def load_draft(draft_dir: str | Path, verifier: str | Path | None = None, attn_impl: str = "sdpa") -> Any:
    """A saved speculators EAGLE-3 draft, with CPU-friendly attention (the saved config defaults to flex)."""
    classes = eagle3_classes()
    config = classes.Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    config.transformer_layer_config._attn_implementation = attn_impl
    if verifier is not None:
        # a draft trained elsewhere names a verifier path of that machine: point it at ours
        config.speculators_config.verifier.name_or_path = str(Path(verifier).expanduser().resolve())
    model = classes.Eagle3DraftModel.from_pretrained(str(draft_dir), config=config)
    model.eval()
    if getattr(model, "d2t", None) is not None or getattr(model, "t2d", None) is not None:
        # lazy: loads pydantic (heavy), which only this path needs
        from eagle3_assets.training.vocab import check_vocab_mapping

        # the draft's own copy of the vocabulary mapping: proposals are mapped to target ids with it
        remedy = "re-materialize vocab_mapping, then draft_model"
        check_vocab_mapping(model.d2t, model.t2d, Path(draft_dir) / "model.safetensors", remedy)
    return model


def draft_verifier_path(model: Any) -> Path:
    return Path(model.config.speculators_config.verifier.name_or_path)


def build_untrained_like(model: Any, seed: int = UNTRAINED_SEED, init: str | None = None) -> Any:
    """A freshly initialized draft of the same shape (layers, vocab mapping, aux layers, norms), seeded.

    ``init``: how training initialized the draft (`TrainConfig.init`; default: its default), so the baseline is
    the trained draft's own starting point and the report shows what training bought.
    """
    # lazy: loads torch (heavy), which only this path needs
    import torch

    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    cfg = model.config
    train_cfg = TrainConfig(
        num_layers=int(cfg.transformer_layer_config.num_hidden_layers),
        ttt_steps=max(1, _saved_k(model)),
        norm_before_residual=bool(cfg.norm_before_residual),
        norm_before_fc=bool(cfg.norm_before_fc),
        norm_output=bool(cfg.norm_output),
        draft_attn_impl="sdpa",
        seed=seed,
        init=init or TrainConfig.init,
    )
    mapping = None
    if model.d2t is not None and model.t2d is not None and int(model.draft_vocab_size) != int(model.t2d.shape[0]):
        mapping = (model.d2t.detach().clone(), model.t2d.detach().clone())
    # seeded without disturbing the caller's RNG stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        untrained = build_draft(draft_verifier_path(model), list(model.target_layer_ids), train_cfg, mapping)
    untrained.eval()
    return untrained


def _saved_k(model: Any) -> int:
    try:
        return int(model.config.speculators_config.proposal_methods[0].speculative_tokens)
    except (AttributeError, IndexError, TypeError, ValueError):
        return 3


def save_untrained_draft(model: Any, out_dir: Path, seed: int = UNTRAINED_SEED, init: str | None = None) -> Path:
    """Build the seeded untrained twin of ``model`` and save it in speculators' format (for vLLM).

    Saved into ``.NAME.tmp-PID`` and put in place with `storage.replace_dir_atomic`: ``out_dir`` is always a whole
    draft (the previous one until the new one is in place). Temporaries of killed earlier saves are swept first.
    """
    untrained = build_untrained_like(model, seed, init)
    out_dir = Path(out_dir)
    remove_dead_writers_temps(out_dir.parent, {out_dir.name})
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        untrained.save_pretrained(str(tmp))
        replace_dir_atomic(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


class VerifierHead:
    """The verifier's final norm + full-vocabulary LM head: its greedy next token from a stored last hidden state."""

    def __init__(self, verifier_path: str | Path, device: Any = "cpu") -> None:
        # lazy: loads torch (heavy), which only this path needs
        import torch

        # lazy: loads transformers (heavy), which only this path needs
        from transformers import AutoConfig

        path = str(verifier_path)
        config = AutoConfig.from_pretrained(path)
        config = getattr(config, "text_config", config)
        weights = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], path)
        head = weights.get("lm_head.weight", weights["embed_tokens.weight"])
        self.lm_head = head.float().to(device)
        self.norm_weight = weights["model.norm.weight"].float().to(device)
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self._torch = torch

    def greedy(self, last_hidden: torch.Tensor) -> torch.Tensor:
        torch = self._torch
        x = last_hidden.to(self.lm_head.device).float()
        # Llama RMSNorm, as the verifier applies it before its LM head
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return (x @ self.lm_head.T).argmax(-1).cpu()


FETCH_CHUNK = 16  # samples whose states one extraction call computes (a batched forward, concurrent requests)


def iter_samples(
    layout: DataLayout,
    partition_key: str,
    max_samples: int | None = None,
    fetch: StatesFetch | None = None,
    data_dir: Path | None = None,
) -> Any:
    """(sample_id, input_ids [T], loss_mask [T], hidden_states [T, n_aux+1, H]) of a partition, in row order.

    A partition built for online training stores some states (a disk budget) or none. ``fetch`` (token id lists ->
    states: :func:`eagle3_assets.training.online_states.fetching`) computes the missing ones; without it only the stored
    samples are yielded, and a partition that stores none is an error naming the remedy.

    Everything comes from ONE version of the partition: ``data_dir`` (a version folder the caller pinned), else
    the current one, pinned until the iteration ends (sample files are read lazily, chunk by chunk: through the
    pointer, a rebuild published meanwhile would pair this index with another build's files).
    """
    index_path = layout.hidden_states_index_path(partition_key)
    if data_dir is None and not index_path.exists():
        raise FileNotFoundError(f"hidden_states partition {partition_key} is not complete (no {index_path})")
    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.hidden_states.state_checks import version_folder

    with version_folder(layout, partition_key, data_dir) as folder:
        yield from _version_samples(layout, partition_key, folder, max_samples, fetch)


def _version_samples(
    layout: DataLayout, partition_key: str, data_dir: Path, max_samples: int | None, fetch: StatesFetch | None
) -> Any:
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    # lazy: loads datasets (heavy), which only this path needs
    from datasets import load_from_disk

    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.hidden_states.state_checks import version_index_path

    index_path = version_index_path(layout, partition_key, data_dir)
    if not index_path.exists():
        raise FileNotFoundError(f"hidden_states partition {partition_key} is not complete (no {index_path})")
    index = pl.read_parquet(index_path).sort("row")
    if fetch is None:
        index = index.filter(index["file"].is_not_null())
        if index.height == 0:
            raise ValueError(
                f"hidden_states partition {partition_key} stores no states (built with store_budget_bytes=0 for "
                "online training): give the offline evaluation the extraction backend (the draft_evaluation asset "
                "uses EAGLE3_HIDDEN_STATES_BACKEND) or re-materialize the partition without a store budget"
            )
    if max_samples is not None:
        index = index.head(max_samples)
    dataset = load_from_disk(str(data_dir))
    records = list(index.iter_rows(named=True))
    for start in range(0, len(records), FETCH_CHUNK):
        yield from _chunk_samples(data_dir, dataset, records[start : start + FETCH_CHUNK], fetch)


def _chunk_samples(data_dir: Path, dataset: Any, records: list[dict[str, Any]], fetch: StatesFetch | None) -> Any:
    # lazy: loads torch (heavy), which only this path needs
    import torch

    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.hidden_states.storage_format import load_states

    rows = [dataset[int(rec["row"])] for rec in records]
    missing = [i for i, rec in enumerate(records) if rec["file"] is None]
    fetched = dict(zip(missing, fetch([rows[i]["input_ids"] for i in missing]), strict=True)) if missing else {}
    for i, (rec, row) in enumerate(zip(records, rows, strict=True)):
        states = fetched[i] if i in fetched else load_states(data_dir / rec["file"])  # FP8: dequantized
        input_ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        loss_mask = torch.as_tensor(row["loss_mask"], dtype=torch.long)
        yield str(rec["sample_id"]), input_ids, loss_mask, states


def anchor_acceptance(
    proposals: torch.Tensor, greedy: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> list[int]:
    """Accepted prefix length per anchor, -1 where the anchor is not simulated.

    ``proposals`` [k, T-1] target ids: proposal j at column c guesses token c+2+j. ``greedy`` [T]: the verifier's
    next token after token s. Column c qualifies when tokens c+1 .. c+1+k are assistant tokens equal to the
    verifier's greedy continuation (greedy[c] .. greedy[c+k]).
    """
    # lazy: loads torch (heavy), which only this path needs
    import torch

    k, cols = proposals.shape
    t = int(input_ids.shape[0])
    out = torch.full((cols,), -1, dtype=torch.long)
    n = t - 1 - k  # columns whose whole window (tokens c+1 .. c+1+k) lies inside the sequence
    if n <= 0:
        return out.tolist()
    consistent = torch.zeros(t, dtype=torch.bool)
    # token s+1 is greedy-consistent and an assistant token
    consistent[1:] = (input_ids[1:] == greedy[:-1]) & (loss_mask[1:] > 0)
    window = torch.stack([consistent[1 + i : 1 + i + n] for i in range(k + 1)]).all(0)
    match = torch.stack([proposals[j, :n] == greedy[1 + j : 1 + j + n] for j in range(k)])
    accepted = match.long().cumprod(0).sum(0)  # length of the matching prefix
    out[:n] = torch.where(window, accepted, -1)
    return out.tolist()


def draft_proposals(
    model: Any, hidden_states: torch.Tensor, input_ids: torch.Tensor, k: int, device: Any = None
) -> torch.Tensor:
    """[k, T-1] target-vocabulary proposals of speculators' forward on one stored sample (shift_batch alignment),
    computed on ``device`` (default: the CPU), returned on the CPU."""
    # lazy: loads torch (heavy), which only this path needs
    import torch

    device = torch.device(device or "cpu")
    n_aux = len(model.target_layer_ids)
    if hidden_states.shape[1] < n_aux:
        raise ValueError(f"stored hidden states hold {hidden_states.shape[1]} layers; the draft needs {n_aux} aux")
    t = int(input_ids.shape[0])
    aux = hidden_states[:, :n_aux, :].reshape(t, -1).to(device).float()
    # shift_batch: hidden state of token c pairs with token c+1; positions start at 1
    hs = aux[:-1].unsqueeze(0)
    ids = input_ids[1:].unsqueeze(0).to(device)
    doc = torch.zeros_like(ids)
    pos = torch.arange(1, t, dtype=torch.long, device=device).unsqueeze(0)
    with torch.no_grad():
        steps = model(hidden_states=hs, input_ids=ids, document_ids=doc, position_ids=pos, ttt_steps=k)
    draft = torch.stack([s.squeeze(0) for s in steps])  # [k, T-1] draft-vocabulary ids
    d2t = getattr(model, "d2t", None)
    if d2t is not None and int(model.draft_vocab_size) != int(model.t2d.shape[0]):
        draft = draft + d2t.to(draft.device)[draft]  # target id = i + d2t[i]
    return draft.cpu()


def walk(accepted: Sequence[int], loss_mask: Sequence[int], k: int) -> list[int]:
    """The anchors vLLM's greedy decode drafts at: from the first assistant token, jump accepted + 1 each draft.

    Column c drafts after token c+1 was emitted; the first emitted token is the first assistant token (prefill
    produces it). Anchors that were not simulated are stepped over one token at a time.
    """
    cols = len(accepted)
    start = next((c for c in range(cols) if loss_mask[c + 1] > 0), None)
    out: list[int] = []
    c = start if start is not None else cols
    while c < cols:
        a = accepted[c]
        if a < 0:
            c += 1
            continue
        out.append(a)
        c += a + 1
    return out


def _stats(label: str, k: int, accepted: Sequence[int], extra: dict[str, Any]) -> AcceptanceStats:
    per_pos = [sum(1 for a in accepted if a > j) for j in range(k)]
    return AcceptanceStats(
        label=label,
        method="offline",
        k=k,
        drafts=len(accepted),
        draft_tokens=k * len(accepted),
        accepted_tokens=int(sum(accepted)),
        accepted_per_position=per_pos,
        extra=extra,
    )


def evaluate_offline(
    models: dict[str, Any],
    layout: DataLayout,
    partition_key: str,
    k: int = SPECULATIVE_TOKENS,
    verifier: str | Path | None = None,
    max_samples: int | None = None,
    log: Callable[[str], None] | None = None,
    num_threads: int | None = None,
    device: str = "auto",
    fetch: StatesFetch | None = None,
    data_dir: Path | None = None,
) -> list[AcceptanceStats]:
    """Offline acceptance of each draft in ``models`` (label -> loaded draft) on one hidden_states partition.

    The drafts run on ``device`` (``EAGLE3_DEVICE``, resolved as training resolves it: ``auto`` is the GPU when there
    is one). The states are the partition's files; ``fetch`` computes those it does not store (a partition built for
    online training). ``data_dir``: the partition's version folder the caller pinned (else the current one, pinned
    while it is read). On a CUDA machine speculators compiles the draft's forward when it is imported
    (``conditional_torch_compile``); on the CPU path that compiled forward runs eagerly (``force_eager``), never
    through the CPU inductor's C++ build.
    """
    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.training.model import resolve_device

    say = log or logger.info
    if k <= 0:
        raise ValueError(f"k={k}: must be a positive integer")
    where = resolve_device(device)
    for model in models.values():
        if hasattr(model, "to"):
            model.to(where)
    first = next(iter(models.values()))
    head = VerifierHead(verifier if verifier is not None else draft_verifier_path(first), where)
    with _eager_on_cpu(where):
        samples = iter_samples(layout, partition_key, max_samples, fetch, data_dir)
        return _evaluate_offline(models, head, partition_key, samples, k, say, num_threads, where)


def _eager_on_cpu(device: Any) -> Any:
    """``torch.compiler.set_stance("force_eager")`` on the CPU: a forward compiled for CUDA runs as plain torch."""

    # lazy: loads torch (heavy), which only this path needs
    import torch

    return torch.compiler.set_stance("force_eager") if device.type == "cpu" else contextlib.nullcontext()


def _evaluate_offline(
    models: dict[str, Any],
    head: VerifierHead,
    partition_key: str,
    samples_iter: Any,
    k: int,
    say: Callable[[str], None],
    num_threads: int | None,
    device: Any,
) -> list[AcceptanceStats]:

    # lazy: loads torch (heavy), which only this path needs
    import torch

    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.hidden_states.backends import torch_threads

    walks: dict[str, list[int]] = {label: [] for label in models}
    every: dict[str, list[int]] = {label: [] for label in models}
    anchors = qualifying = samples = 0
    started = time.perf_counter()
    # one core left free: on a busy 2-core machine two OpenMP threads spin against vLLM and run many times slower
    with torch_threads(num_threads):
        for _sample_id, input_ids, loss_mask, hidden in samples_iter:
            if int(input_ids.shape[0]) < k + 3:
                continue
            samples += 1
            greedy = head.greedy(hidden[:, -1, :])
            anchors += int((loss_mask[1:-1] > 0).sum())
            counted = False
            for label, model in models.items():
                with torch.no_grad():
                    proposals = draft_proposals(model, hidden, input_ids, k, device)
                accepted = anchor_acceptance(proposals, greedy, input_ids, loss_mask)
                if not counted:
                    qualifying += sum(1 for a in accepted if a >= 0)
                    counted = True
                every[label].extend(a for a in accepted if a >= 0)
                walks[label].extend(walk(accepted, loss_mask.tolist(), k))
    seconds = time.perf_counter() - started
    coverage = qualifying / anchors if anchors else 0.0
    say(
        f"offline evaluation on partition {partition_key}: {samples} samples, {qualifying}/{anchors} assistant "
        f"anchors greedy-consistent ({coverage:.1%}), {seconds:.1f} s"
    )
    out = []
    for label in models:
        every_stats = _stats(label, k, every[label], {})
        extra = {
            "partition": partition_key,
            "samples": samples,
            "weighting": "decode walk",
            "coverage": coverage,
            "every_position_mean_acceptance_length": every_stats.mean_acceptance_length,
            "every_position_acceptance_rate": every_stats.acceptance_rate_per_position,
            "every_position_anchors": every_stats.drafts,
            "seconds": seconds,
        }
        out.append(_stats(label, k, walks[label], extra))
    return out
