"""The Dagster layer: thin assets, checks and resources over the Dagster-free core modules."""
