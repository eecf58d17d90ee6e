"""The target model as every stage sees it: tokenizer, model and fingerprint, all from ``cfg.target``.

Stages used to call the loaders with the fields they remembered to pass, and one forgot the revision
and the separate tokenizer when tokenising prompts. :class:`Target` takes the whole
:class:`~pipeline.config.sections.TargetConfig`, so no caller can drop a field: the tokenizer comes from
``target.tokenizer`` (else the model's own) at ``target.revision``, the model in ``target.dtype``, and
the fingerprint stamped on artifacts is computed from exactly the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config.sections import TargetConfig
from pipeline.models.context import tokenizer_too_large
from pipeline.models.loading import (
    fingerprint,
    load_generation_config,
    load_model,
    load_tokenizer,
    read_model_config,
)


@dataclass(frozen=True)
class Target:
    """Loader for one configured target. Cheap to build; loads happen on the calls."""

    cfg: TargetConfig

    @property
    def tokenizer_name(self) -> str:
        """Where the tokenizer comes from: ``target.tokenizer`` when set, else the model."""
        return self.cfg.tokenizer or self.cfg.model

    def tokenizer(self) -> Any:
        """The target's tokenizer (``target.tokenizer`` or the model's own, at ``target.revision``)."""
        return load_tokenizer(self.tokenizer_name, self.cfg.revision, trust_remote_code=self.cfg.trust_remote_code)

    def model(self, device: str | None = None, dtype: str | None = None) -> Any:
        """The target model in ``dtype`` (default ``target.dtype``), eval mode, on ``device`` if given.

        Raises:
            DrafterError: ``target.tokenizer`` holds more ids than the model has embedding rows (its high ids would
                index past the embedding deep in a stage). ``plan`` refuses it where the model's config is read
                without the model; a tiny-kit ref's only shows here.
        """
        model = load_model(self.cfg.model, self.cfg.revision, dtype=dtype or self.cfg.dtype, device=device,
                           trust_remote_code=self.cfg.trust_remote_code)
        rows = model.get_input_embeddings().num_embeddings
        if self.cfg.tokenizer and self.cfg.tokenizer != self.cfg.model and (ids := len(self.tokenizer())) > rows:
            raise tokenizer_too_large(self.cfg.tokenizer, self.cfg.model, ids, rows)
        return model

    def checkpoint_dtype(self) -> Any:
        """The floating dtype the checkpoint's ``config.json`` declares (a ``torch.dtype``), else None. A serving
        engine's ``--dtype auto`` loads the target, and SGLang a drafter, in the dtype its config declares; a stage
        loads the target in ``target.dtype`` and reads the loaded config's dtype as that, not as the checkpoint's."""
        import torch

        declared = getattr(read_model_config(self.cfg.model, self.cfg.revision,
                                             trust_remote_code=self.cfg.trust_remote_code), "dtype", None)
        if isinstance(declared, str):
            declared = getattr(torch, declared, None)
        return declared if isinstance(declared, torch.dtype) and declared.is_floating_point else None

    @property
    def generation_config(self) -> Any:
        """The model's generation config (None without one), read without its weights: ``stop_ids(tokenizer,
        target)`` gives where its answers end for a stage that never loads the model."""
        return load_generation_config(self.cfg.model, self.cfg.revision)

    @property
    def fingerprint(self) -> dict:
        """Model name, revision and the vocabulary hash of :meth:`tokenizer` (cached per process)."""
        return fingerprint(self.cfg.model, self.cfg.revision, self.cfg.tokenizer, self.cfg.trust_remote_code)
