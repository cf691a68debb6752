"""Reading a prompt dataset (Dagster-free): files to decoded rows (``prompt_files``: JSONL, Parquet, JSON arrays,
``package:NAME``), rows to normalized conversations with rejects and duplicates (``conversations``), the
``raw_prompts`` table written from that scan in bounded memory (``prompt_table``), and the shipped sample dataset
(``sample_data``). ``defs/prompts.py`` is the same concept one layer up: the ``raw_prompts`` asset over this room.
"""
