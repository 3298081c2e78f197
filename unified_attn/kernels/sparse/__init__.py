"""Gathered-row attention (`gathered_attention`, `gathered_attention_sm90`) and the lightning
indexer's scores (`indexer_scores`)."""
