"""Request fingerprints: a hash of everything that determines a response row's answer (pure, Dagster-free).

A row of ``synthetic_responses`` is *current* when its ``request_fingerprint`` equals the fingerprint of the
request this run would send for its prompt: same rendered messages, same model (and revision when known), same
sampling parameters (max_tokens, temperature, top_p, seed and every extra body field, which is where chat
template and reasoning switches such as ``chat_template_kwargs`` travel). Resume keeps only current rows; a
prompt edited under the same ``sample_id``, a raised ``EAGLE3_MAX_TOKENS`` or another model makes the row stale
and it is generated again. Rows written before fingerprints existed have none and are stale too.

Fields that change how a request travels but not what it answers (timeouts, concurrency, transport, streaming,
``return_token_ids``) are deliberately left out: changing them must not throw finished work away.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_assets.core.hashing import digest

# Bump when the hashed payload changes shape: every stored row then counts as stale once, by design.
FINGERPRINT_VERSION = 1
FINGERPRINT_COLUMN = "request_fingerprint"

# Why a stored row is not current (counted in the run log and the materialization metadata).
STALE_PROMPT = "prompt changed"
STALE_SETTINGS = "model or sampling settings changed"
STALE_UNFINGERPRINTED = "written before request fingerprints"


def messages_payload(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The rendered messages as they are sent and stored: role and content only, content never None."""
    return [
        {"role": str(m["role"]), "content": "" if m.get("content") is None else str(m["content"])} for m in messages
    ]


@dataclass(frozen=True)
class FingerprintInputs:
    """What, besides the prompt, determines an answer. Stored in each partition's manifest (its lineage)."""

    model: str
    sampling_params: Mapping[str, Any]  # max_tokens, temperature, top_p, seed, extra body fields
    model_revision: str | None = None  # when the server or the configuration names one

    def as_dict(self) -> dict[str, Any]:
        return {
            "fingerprint_version": FINGERPRINT_VERSION,
            "model": self.model,
            "model_revision": self.model_revision,
            "sampling_params": dict(self.sampling_params),
        }

    @property
    def settings_digest(self) -> str:
        """The hash of the settings alone: equal for every row of a partition generated with them."""
        return digest(self.as_dict(), 64)


def request_fingerprint(settings_digest: str, messages: Iterable[Mapping[str, Any]]) -> str:
    """The fingerprint of one request: settings digest + the rendered messages."""
    return digest([settings_digest, messages_payload(messages)])


def fingerprints_for(inputs: FingerprintInputs, prompts: Iterable[Any]) -> dict[str, str]:
    """sample_id -> fingerprint for prompts with ``sample_id`` and ``messages`` attributes."""
    settings = inputs.settings_digest
    return {p.sample_id: request_fingerprint(settings, p.messages) for p in prompts}


def stale_reason(record: Mapping[str, Any], current: str, messages: Sequence[Mapping[str, Any]]) -> str | None:
    """None when ``record`` answers the current request; otherwise why not (one of the ``STALE_*`` texts)."""
    stored = record.get(FINGERPRINT_COLUMN)
    if stored == current:
        return None
    if not stored:
        return STALE_UNFINGERPRINTED
    stored_messages = record.get("messages")
    if stored_messages is not None and messages_payload(stored_messages) != messages_payload(messages):
        return STALE_PROMPT
    return STALE_SETTINGS


def prompt_set_digest(rows: Iterable[tuple[str, Sequence[Mapping[str, Any]]]]) -> str:
    """A hash of a partition's prompt set ((sample_id, messages) pairs, order-independent): it changes when a
    prompt is appended to the partition, dropped from it or edited under its id."""
    return digest(sorted([sid, messages_payload(msgs)] for sid, msgs in rows))
