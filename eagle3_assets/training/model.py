"""The EAGLE-3 draft: built the way ``speculators train`` builds it, plus this project's ``token_copy`` init.

The draft is speculators' ``Eagle3DraftModel`` (``from_training_args``: the verifier's embeddings, LM head and norm
loaded, the draft decoder shaped from the verifier), so what is saved is exactly what its CLI would produce and what
vLLM serves. On CPU it is built with ``draft_attn_impl="sdpa"`` (flex attention has no CPU backward) and trained
with ``loss_implementation="eager"`` (the fused loss needs Triton).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.verifier import verifier_shape
from eagle3_assets.speculators_adapter import create_transformer_layer_config, eagle3_classes
from eagle3_assets.training.train_config import TrainConfig

if TYPE_CHECKING:
    import torch

# token_copy gains: the self-attention logit (per head, over sqrt(head_dim)) that beats ~e^8 other positions, and
# the copied embedding's weight against the normalized residual (rms 1).
_SELF_SCORE = 18.0
_COPY_GAIN = 3.0


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one (under torchrun: this rank's), else the CPU."""

    # lazy: loads torch (heavy), which only this path needs
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        # one GPU per rank; more ranks than GPUs share them round-robin (the GPU check runs 2 ranks on 1 GPU)
        name = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
    return torch.device(name)


def build_draft(
    verifier_path: Path,
    layer_ids: list[int],
    config: TrainConfig,
    mapping: tuple[Any, Any] | None,
) -> Any:
    """A freshly initialized EAGLE-3 draft for this verifier, built the way ``speculators train`` builds it."""
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=str(verifier_path),
        num_layers=config.num_layers,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=2048,
        # full attention everywhere: the plain Llama draft vLLM's llama_eagle3 serves
        full_attention_indices=list(range(config.num_layers)),
    )
    d2t, t2d = mapping if mapping is not None else (None, None)
    target_vocab = verifier_shape(verifier_path).vocab_size
    if t2d is not None and int(t2d.shape[0]) != target_vocab:
        raise ValueError(
            f"vocab_mapping was built for a {int(t2d.shape[0])}-token target vocabulary but the verifier at "
            f"{verifier_path} has {target_vocab}: rebuild vocab_mapping for this verifier"
        )
    draft_vocab_size = int(d2t.shape[0]) if d2t is not None else target_vocab
    model = eagle3_classes().Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(verifier_path),
        target_layer_ids=layer_ids,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=config.norm_before_residual,
        norm_before_fc=config.norm_before_fc,
        norm_output=config.norm_output,
        ttt_steps=config.ttt_steps,
        draft_attn_impl=config.draft_attn_impl,
    )
    if config.init == "token_copy":
        init_token_copy(model)
    return model


def init_token_copy(model: Any) -> None:
    """Start the first draft layer as "carry the new token forward".

    An EAGLE-3 draft predicts token t+2 from the verifier's states at t and the embedding of token t+1, which enters
    the first layer only through attention (the residual is the verifier's states). From a random init, attention
    must first learn to pick out its own position among all earlier ones: measured on the demo's tiny verifier,
    120 steps left the draft at 10% top-1 accuracy; with this init 60 steps reach 52% (docs/local_vllm.md). Here
    each head's query and key read the same slice of the normalized embedding (so a position scores itself
    ~``_SELF_SCORE`` above the others), its value copies that slice, and the output projection writes it back, at
    ``_COPY_GAIN``, into the dimensions it came from. Every other weight keeps speculators' init; training moves all.
    """
    # lazy: loads torch (heavy), which only this path needs
    import torch

    layer = model.layers[0]
    attn = layer.self_attn
    hidden = int(model.hidden_size)
    head_dim = int(attn.head_dim)
    q_heads = attn.q_proj.weight.shape[0] // head_dim
    kv_heads = attn.k_proj.weight.shape[0] // head_dim
    group = q_heads // kv_heads
    beta = (_SELF_SCORE / head_dim**0.5) ** 0.5
    eye = torch.eye(head_dim)
    with torch.no_grad():
        # Inputs are cat([embeds, hidden]): columns [0, hidden) are the embedding half.
        for q_head in range(q_heads):
            kv_head = q_head // group
            cols = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
            if cols.stop > hidden:  # more head dims than the embedding has: those heads keep their random init
                continue
            rows = slice(q_head * head_dim, (q_head + 1) * head_dim)
            kv_rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
            # the hidden half keeps its random init: context still reaches the scores and values from step one
            attn.q_proj.weight[rows, :hidden] = 0.0
            attn.q_proj.weight[rows, cols] = beta * eye
            attn.k_proj.weight[kv_rows, :hidden] = 0.0
            attn.k_proj.weight[kv_rows, cols] = beta * eye
            attn.v_proj.weight[kv_rows, :hidden] = 0.0
            attn.v_proj.weight[kv_rows, cols] = eye
            attn.o_proj.weight[:, rows] = 0.0
            attn.o_proj.weight[cols, rows] = (_COPY_GAIN / group) * eye


def trainer_kwargs(config: TrainConfig) -> dict[str, Any]:
    train_kwargs, _val_kwargs = eagle3_classes().Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=config.loss_fn,
        loss_implementation="eager",
        ttt_steps=config.ttt_steps,
        ttt_step_loss_decay=config.ttt_step_loss_decay,
    )
    return train_kwargs
