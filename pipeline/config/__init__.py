"""Configuration: the generic dataclass/YAML/override machinery (:mod:`.schema`) and the pipeline's
sections (:mod:`.sections`)."""
