"""What each family of draft methods is built from: one small frozen dataclass per family.

A proposer factory of :mod:`pipeline.engine.methods` takes exactly one of these, so it asks for what it
needs and nothing else (HF transformers' candidate generators do the same: prompt lookup takes no model,
assisted generation a model, different tokenizers both tokenizers). Two class attributes say where the
evaluate stage gets an inputs object's parts, and so what a method of the family costs a plan:

* ``MODEL``: the ``evaluate`` config key naming the drafter model it loads (its fingerprint enters the
  evaluate id), or None when its drafter is an upstream artifact;
* ``STAGES``: the upstream stages whose artifacts it reads besides ``count`` (evaluate reads them only
  when an evaluated method needs them).

Every family takes ``name`` (a label for metrics; None keeps the proposer's default) and, where its
proposer reports ``q`` over a width it cannot know from its own drafter, ``target_vocab_size`` (None lets
the proposer infer it; text-level SLEM verifies by exact match and needs none). Importing this module is light: the
field types are annotations only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from pipeline.drafters.dflash import DFlashDrafter
    from pipeline.drafters.eagle3 import Eagle3Drafter
    from pipeline.dynaspec.budget import ShortlistPolicy
    from pipeline.dynaspec.clusters import Clustering
    from pipeline.dynaspec.router import Router
    from pipeline.rdk.prior import RDKPrior
    from pipeline.vocab.maps import VocabMap

Tokenizer = Any
"""A Hugging Face tokenizer; the engine duck-types it (encode, decode, its vocabulary), so tests may pass
a toy one."""

DRAFTER_MODELS: tuple[str, ...] = ("drafter", "drafter_other", "drafter_bytes")
"""The ``evaluate`` config keys that name drafter models, in the order the evaluate id lists them."""


@dataclass(frozen=True)
class SameTokenizerInputs:
    """A causal LM sharing the target's tokenizer, drafting with its whole LM head.

    Attributes:
        drafter: The drafter (``evaluate.drafter``).
    """

    MODEL: ClassVar[str | None] = "drafter"
    STAGES: ClassVar[tuple[str, ...]] = ()

    drafter: torch.nn.Module
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class ShortlistInputs:
    """The same-tokenizer drafter with its LM head cut to one static shortlist of the ``count`` artifact.

    Attributes:
        drafter: The drafter (``evaluate.drafter``).
        shortlist: 1-D tensor of the target ids the head keeps.
    """

    MODEL: ClassVar[str | None] = "drafter"
    STAGES: ClassVar[tuple[str, ...]] = ()

    drafter: torch.nn.Module
    shortlist: torch.Tensor
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class FrequencyInputs:
    """The same-tokenizer drafter with a position-aware shortlist of the most frequent tokens.

    Attributes:
        drafter: The drafter (``evaluate.drafter``).
        policy: Its frequency ranking, ``pa_fr_kmax`` per γ, kept tokens and ``k_min``.
    """

    MODEL: ClassVar[str | None] = "drafter"
    STAGES: ClassVar[tuple[str, ...]] = ()

    drafter: torch.nn.Module
    policy: ShortlistPolicy
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class RoutedInputs:
    """The same-tokenizer drafter whose head a router restricts to the clusters it picks per step.

    Attributes:
        drafter: The drafter (``evaluate.drafter``).
        clustering: The clustering of the drafter's LM head (a ``cluster`` artifact).
        router: A router trained for that clustering (a ``train_router`` artifact).
        policy: The cluster budgets (fixed and position-aware) per γ and the kept tokens.
    """

    MODEL: ClassVar[str | None] = "drafter"
    STAGES: ClassVar[tuple[str, ...]] = ("cluster", "train_router")

    drafter: torch.nn.Module
    clustering: Clustering
    router: Router
    policy: ShortlistPolicy
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class FeatureInputs:
    """A draft head conditioned on the target's hidden states.

    Attributes:
        eagle3: An EAGLE-3 drafter trained for this target (a ``train_drafter`` artifact), on the target's
            device (it holds the target's embedding by reference).
    """

    MODEL: ClassVar[str | None] = None
    STAGES: ClassVar[tuple[str, ...]] = ("train_drafter",)

    eagle3: Eagle3Drafter
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class BlockFeatureInputs:
    """A block drafter conditioned on the target's hidden states (DFlash: a whole block per forward).

    Attributes:
        dflash: A DFlash drafter trained for this target (a ``train_dflash`` artifact), on the target's device
            (it holds the target's embedding and LM head by reference).
    """

    MODEL: ClassVar[str | None] = None
    STAGES: ClassVar[tuple[str, ...]] = ("train_dflash",)

    dflash: DFlashDrafter
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class OtherTokenizerInputs:
    """A causal LM with a tokenizer of its own, bridged to the target through text (no vocabulary map).

    Attributes:
        drafter_other: The drafter (``evaluate.drafter_other``).
        drafter_other_tokenizer: Its tokenizer.
        target_tokenizer: The target's tokenizer.
    """

    MODEL: ClassVar[str | None] = "drafter_other"
    STAGES: ClassVar[tuple[str, ...]] = ()

    drafter_other: torch.nn.Module
    drafter_other_tokenizer: Tokenizer
    target_tokenizer: Tokenizer
    name: str | None = None


@dataclass(frozen=True)
class CrossVocabInputs:
    """A drafter with a tokenizer of its own whose tokens map onto the target's through their intersection.

    Attributes:
        drafter_other: The drafter (``evaluate.drafter_other``).
        drafter_other_tokenizer: Its tokenizer.
        target_tokenizer: The target's tokenizer.
        vocab_map: ``VocabMap.build(target_tokenizer, drafter_other_tokenizer)``.
    """

    MODEL: ClassVar[str | None] = "drafter_other"
    STAGES: ClassVar[tuple[str, ...]] = ()

    drafter_other: torch.nn.Module
    drafter_other_tokenizer: Tokenizer
    target_tokenizer: Tokenizer
    vocab_map: VocabMap
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class RDKInputs:
    """The same-tokenizer drafter pruned to one kept set of an RDK prior.

    Attributes:
        drafter: The drafter (``evaluate.drafter``).
        prior: The RDK prior for this target (an ``estimate_rdk`` artifact).
        level: The kept set it drafts over (``keep_<fraction>``).
    """

    MODEL: ClassVar[str | None] = "drafter"
    STAGES: ClassVar[tuple[str, ...]] = ("estimate_rdk",)

    drafter: torch.nn.Module
    prior: RDKPrior
    level: str
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class CrossRDKInputs:
    """A drafter with a tokenizer of its own drafting onto ``T ∩ D``, then redistributed by an RDK prior.

    Attributes:
        drafter_other: The drafter (``evaluate.drafter_other``).
        drafter_other_tokenizer: Its tokenizer.
        target_tokenizer: The target's tokenizer.
        vocab_map: ``VocabMap.build(target_tokenizer, drafter_other_tokenizer)``.
        prior: The RDK prior for this target (an ``estimate_rdk`` artifact); its ``intersection`` kept set.
    """

    MODEL: ClassVar[str | None] = "drafter_other"
    STAGES: ClassVar[tuple[str, ...]] = ("estimate_rdk",)

    drafter_other: torch.nn.Module
    drafter_other_tokenizer: Tokenizer
    target_tokenizer: Tokenizer
    vocab_map: VocabMap
    prior: RDKPrior
    target_vocab_size: int | None = None
    name: str | None = None


@dataclass(frozen=True)
class ByteInputs:
    """A causal LM whose vocabulary is the 256 single bytes plus specials.

    Attributes:
        drafter_bytes: The drafter (``evaluate.drafter_bytes``).
        drafter_bytes_tokenizer: Its tokenizer.
        target_tokenizer: The target's tokenizer.
        byte_top_k: SLRS's bytes kept per draw (the string trie's branching factor).
        lookahead: SLRS's bytes per drafted string; SLEM on bytes drafts as many bytes per target token.
    """

    MODEL: ClassVar[str | None] = "drafter_bytes"
    STAGES: ClassVar[tuple[str, ...]] = ()

    drafter_bytes: torch.nn.Module
    drafter_bytes_tokenizer: Tokenizer
    target_tokenizer: Tokenizer
    byte_top_k: int = 4
    lookahead: int = 4
    target_vocab_size: int | None = None
    name: str | None = None

