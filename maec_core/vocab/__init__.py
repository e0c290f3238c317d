"""Merging models whose vocabularies differ: output tokenizer, row remapping."""
