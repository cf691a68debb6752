"""eagle3-assets: a Dagster asset graph that turns prompts into a trained EAGLE-3 draft model."""

__version__ = "0.1.0"
