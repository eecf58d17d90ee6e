"""Vocabulary work: token byte meanings and the vocabulary hash, cross-tokenizer maps (T∩D), and
loss-masked token counting with the shortlists and draft vocabularies built on it."""
