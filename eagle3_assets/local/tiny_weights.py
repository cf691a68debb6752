"""The tiny verifier's weights: seeded random tensors plus the hand-set channels described in ``tiny_model``.

Every tensor comes from one numpy PCG64 stream in a fixed order (embeddings, trigger permutation, the layers in
order, the LM head), so the same seed gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_assets.local.tiny_spec import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    THINK_TOKENS,
    TinyModelSpec,
)

# Residual channels reserved for the hand-set mechanism, counted from the end of the hidden vector.
_CH_ONE, _CH_THINK_END, _CH_SEEN, _CH_TRIG_THINK, _CH_TRIG_EOS = 1, 2, 3, 4, 5
_NUM_RESERVED = 5


@dataclass(frozen=True)
class _Channels:
    one: int
    think_end: int
    seen: int
    trig_think: int
    trig_eos: int

    @property
    def reserved(self) -> list[int]:
        return [self.one, self.think_end, self.seen, self.trig_think, self.trig_eos]


def build_weights(
    spec: TinyModelSpec,
    ids: dict[str, int],
    seed: int,
    trigger_candidates: Sequence[int] | None = None,
    suppressed: Sequence[int] = (),
) -> dict[str, Any]:
    """All tensors of the LlamaForCausalLM state dict as float32 numpy arrays (HF names).

    ``trigger_candidates``: token ids allowed to trigger </think> / eos (default: every ordinary token).
    ``suppressed``: ordinary token ids the model must never generate (strongly negative logit).
    """
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(seed))
    h, hd, nh = spec.hidden_size, spec.head_dim, spec.num_heads
    if nh * hd != h:
        raise ValueError(f"num_heads*head_dim={nh * hd} must equal hidden_size={h}")
    if h <= 4 * _NUM_RESERVED:
        raise ValueError(f"hidden_size={h} too small")
    channels = _Channels(*(h - c for c in (_CH_ONE, _CH_THINK_END, _CH_SEEN, _CH_TRIG_THINK, _CH_TRIG_EOS)))
    special_ids = [ids[t] for t in (*SPECIAL_TOKENS, *THINK_TOKENS)]
    ordinary = np.setdiff1d(np.arange(spec.vocab_size), np.array(special_ids))

    embed = _embeddings(rng, spec, ids, channels, ordinary, trigger_candidates)
    tensors: dict[str, Any] = {"model.embed_tokens.weight": embed}
    for layer in range(spec.num_layers):
        tensors.update(_decoder_layer(rng, spec, layer, channels, embed, ordinary, ids))
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    tensors["lm_head.weight"] = _lm_head(rng, spec, ids, channels, embed, special_ids, suppressed)
    return tensors


def _normal(rng: Any, shape: tuple[int, ...], std: float) -> Any:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def _embeddings(
    rng: Any,
    spec: TinyModelSpec,
    ids: dict[str, int],
    channels: _Channels,
    ordinary: Any,
    trigger_candidates: Sequence[int] | None,
) -> Any:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    embed = _normal(rng, (spec.vocab_size, spec.hidden_size), spec.embed_std)
    embed[:, channels.reserved] = 0.0
    embed[:, channels.one] = 1.0
    embed[ids[THINK_END_TOKEN], channels.think_end] = 1.0
    candidates = ordinary if trigger_candidates is None else np.array(sorted(trigger_candidates), dtype=np.int64)
    if len(candidates) < 4:  # a tiny corpus has few merged tokens: any ordinary token may trigger then
        candidates = ordinary
    perm = rng.permutation(candidates)
    # Fractions are of the whole vocabulary; with few candidates, at most a third of them each.
    n_think = max(1, min(round(spec.think_trigger_fraction * len(ordinary)), len(perm) // 3))
    n_eos = max(1, min(round(spec.eos_trigger_fraction * len(ordinary)), len(perm) // 3))
    embed[perm[:n_think], channels.trig_think] = 1.0
    embed[perm[n_think : n_think + n_eos], channels.trig_eos] = 1.0
    return embed


def _decoder_layer(
    rng: Any, spec: TinyModelSpec, layer: int, channels: _Channels, embed: Any, ordinary: Any, ids: dict[str, int]
) -> dict[str, Any]:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    h, hd, nh = spec.hidden_size, spec.head_dim, spec.num_heads
    q = _normal(rng, (nh * hd, h), spec.layer_std)
    k = _normal(rng, (nh * hd, h), spec.layer_std)
    vv = _normal(rng, (nh * hd, h), spec.layer_std)
    o = _normal(rng, (h, nh * hd), spec.layer_std)
    gate = _normal(rng, (spec.intermediate_size, h), spec.layer_std)
    up = _normal(rng, (spec.intermediate_size, h), spec.layer_std)
    down = _normal(rng, (h, spec.intermediate_size), spec.layer_std)
    # Only the dedicated head writes to the reserved channels.
    o[channels.reserved, :] = 0.0
    down[channels.reserved, :] = 0.0
    if layer == 0:
        # Head 0: "has </think> appeared?"  The lowest-frequency RoPE pair is (hd/2 - 1, hd - 1); with
        # rope_theta 5e5 it rotates by < 0.01 rad over 2048 positions, so the score is position-free.
        head = slice(0, hd)
        q[head, :] = 0.0
        k[head, :] = 0.0
        vv[head, :] = 0.0
        o[:, head] = 0.0
        # RMSNorm scales a token's row by sqrt(h)/|row|; compute the normalized values to set exact gains.
        e_one = _normed(embed[ordinary], channels.one).mean()
        e_think = _normed(embed[[ids[THINK_END_TOKEN]]], channels.think_end)[0]
        score = 40.0  # logit of attending to a </think> position; others score 0
        q[hd // 2 - 1, channels.one] = np.float32(np.sqrt(score * np.sqrt(hd)) / e_one)
        k[hd // 2 - 1, channels.think_end] = np.float32(np.sqrt(score * np.sqrt(hd)) / e_think)
        vv[0, channels.think_end] = np.float32(1.0 / e_think)
        o[channels.seen, 0] = 1.0  # SEEN becomes exactly 1.0 (like ONE) once </think> is in context
    p = f"model.layers.{layer}."
    return {
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": vv,
        p + "self_attn.o_proj.weight": o,
        p + "mlp.gate_proj.weight": gate,
        p + "mlp.up_proj.weight": up,
        p + "mlp.down_proj.weight": down,
        p + "input_layernorm.weight": np.ones(h, dtype=np.float32),
        p + "post_attention_layernorm.weight": np.ones(h, dtype=np.float32),
    }


def _lm_head(
    rng: Any,
    spec: TinyModelSpec,
    ids: dict[str, int],
    channels: _Channels,
    embed: Any,
    special_ids: list[int],
    suppressed: Sequence[int],
) -> Any:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    h = spec.hidden_size
    lm_head = _normal(rng, (spec.vocab_size, h), spec.lm_head_std)
    lm_head[:, channels.reserved] = 0.0
    # No immediate repetition: push each token's output row away from its own embedding, so "x x x x" loops (a
    # random next-token map has fixed points) cannot start; the logit of t drops by ~5 std when t is current.
    free = np.ones(h, dtype=bool)
    free[channels.reserved] = False
    own = embed[:, free] / np.linalg.norm(embed[:, free], axis=1, keepdims=True)
    lm_head[:, free] -= np.float32(5.0 * spec.lm_head_std) * own.astype(np.float32)
    # Final RMSNorm divides by the residual's rms (~ a few units); gains are in "raw residual units" and large
    # enough to beat the max of ~4k random logits (std ~ lm_head_std * sqrt(h)).
    gain = np.float32(12.0 * spec.lm_head_std * np.sqrt(h))
    lm_head[special_ids, :] = 0.0
    for token in (BOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, THINK_START_TOKEN):
        lm_head[ids[token], channels.one] = -gain
    if len(suppressed):
        rows = np.array(sorted(suppressed), dtype=np.int64)
        lm_head[rows, :] = 0.0
        lm_head[rows, channels.one] = -gain
    lm_head[ids[THINK_END_TOKEN], channels.trig_think] = gain
    lm_head[ids[THINK_END_TOKEN], channels.seen] = -2 * gain
    lm_head[ids[EOS_TOKEN], channels.trig_eos] = gain
    lm_head[ids[EOS_TOKEN], channels.seen] = 2 * gain
    lm_head[ids[EOS_TOKEN], channels.one] = -2 * gain
    return (lm_head * np.float32(spec.logit_scale)).astype(np.float32)


def _normed(rows: Any, channel: int) -> Any:
    # lazy: loads numpy (heavy), which only this path needs
    import numpy as np

    rms = np.sqrt(np.mean(rows.astype(np.float64) ** 2, axis=1))
    return rows[:, channel] / rms
