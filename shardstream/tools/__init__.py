"""Looking after a dataset: a manifest for others' shards, verification, previews."""
