"""Loading models and tokenizers (hub ids, local paths, tiny-kit refs), fingerprints, and the target
helper every stage uses to get the target's tokenizer, model and fingerprint from ``cfg.target``."""
