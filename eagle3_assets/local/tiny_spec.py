"""The tiny verifier's constants: its special tokens and :class:`TinyModelSpec` (shapes and the knobs of the
structured random init), shared by the builder (``tiny_model``) and the weights (``tiny_weights``)."""

from __future__ import annotations

from dataclasses import dataclass

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
# Truly special tokens (stripped by skip_special_tokens).  <think>/</think> are *not* special: vLLM's reasoning
# parser (deepseek_r1) looks for "</think>" in the decoded text, which skip_special_tokens would remove.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN)
THINK_TOKENS = (THINK_START_TOKEN, THINK_END_TOKEN)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shapes and the knobs of the structured random init (see module docstring)."""

    num_layers: int = 4
    hidden_size: int = 256
    vocab_size: int = 4096
    num_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    # Scale of the random parts. Embeddings O(1); layers strong enough that the prompt changes the greedy path,
    # weak enough that the next token stays mostly a function of the current token (easy for a draft model).
    embed_std: float = 1.0
    layer_std: float = 0.05
    lm_head_std: float = 0.12
    # Fraction of ordinary tokens that trigger </think> / eos (mean lengths ~ 1/fraction tokens).
    think_trigger_fraction: float = 0.02
    eos_trigger_fraction: float = 0.035
    # Multiplies the whole lm_head: the greedy path is unchanged, but the next-token distribution is as peaked as
    # a trained LLM's on its own greedy text (top-1 ~0.07 unscaled: a draft distilled from near-uniform targets
    # barely learns the argmax).
    logit_scale: float = 4.0
