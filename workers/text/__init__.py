"""Tokenizer, incremental detokenizer and stop strings."""
