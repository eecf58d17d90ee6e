"""The ``train_dflash`` section (a DFlash block drafter), each field documented below it; checked when the config is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.schema import check_seed, check_value, input_override
from pipeline.config.training import TrainConfig
from pipeline.errors import DrafterError


def _dflash_training() -> TrainConfig:
    # A freshly initialised drafter of a few layers: AdamW as for EAGLE-3, checkpoint choice by held-out
    # simulated tau every 100 steps.
    return TrainConfig(lr=6e-4, warmup_steps=50, global_batch_size=16, micro_batch_size=4, eval_every=100,
                       checkpoint_every=100)


DFLASH_LOSSES: tuple[str, ...] = ("ce", "kl")
"""The values of ``train_dflash.loss`` (what each means: :class:`TrainDFlashConfig`)."""
DFLASH_HEADS: tuple[str, ...] = ("target", "draft")
"""The values of ``train_dflash.head``."""


@dataclass
class TrainDFlashConfig:
    calibration: str | None = input_override()
    """Train on this calibration artifact directory instead of the one ``generate`` builds for this config
    (its artifact id, not this path, enters the train_dflash id)."""
    counts: str | None = input_override()
    """With head draft: take the draft vocabulary from this count artifact directory instead of the one ``count``
    builds for this config."""
    num_layers: int = 1
    """Draft layers (Qwen3-style decoder layers; the published Qwen3-8B drafter has 5)."""
    block_size: int = 8
    """B: the block's rows (the last verified token and B - 1 masks); the drafter proposes up to B - 1 tokens per
    forward, so evaluate.gammas with method dflash are at most B - 1 (checked at plan time)."""
    target_layer_ids: list[int] | None = None
    """Tapped target layers in the reference numbering (id i = output of layer i = output_hidden_states[i + 1]).
    null: one draft layer taps the middle layer L // 2 (at most L - 2); more take the reference spread over
    1 .. L - 3 (Qwen3-8B, 5 layers: [1, 9, 17, 25, 33]), and shallower targets over 0 .. L - 2. The speculators export
    stores these + 1 (aux_hidden_state_layer_ids). At most L - 2: the last layer's output is taken after the final
    norm, which no server hands a drafter."""
    mask_token_id: int | None = None
    """The token whose frozen target embedding fills the masked rows; null: the tokenizer's <|MASK|> token (the
    reference drafters' and the one SGLang checks this id against), else its pad token, else its unknown token, else
    the last id of the vocabulary."""
    num_key_value_heads: int | None = None
    """Key/value heads of each draft layer; null: the target's. A block row reads the context only through them, so
    more (up to the target's query heads: plain multi-head attention) widen what one layer can read, at a little
    more compute; vLLM and SGLang read the drafter's own attention shape from its config."""
    num_attention_heads: int | None = None
    """Query heads of each draft layer (each the target's head_dim wide); null: the target's. A multiple of
    num_key_value_heads."""
    intermediate_size: int | None = None
    """MLP width of each draft layer; null: the target's. Like num_key_value_heads, read by the servers from the
    drafter's config; a wider layer adds arithmetic, not kernel launches, to the one forward a round."""
    head: str = "target"
    """target: the target's LM head, frozen, over its whole vocabulary (the reference DFlash; not saved). draft: the
    drafter's own head over count's draft vocabulary (count.draft_vocab_size ids, the EAGLE-3 drafter's), started
    from the target's rows and trained; saved with its d2t/t2d maps, as speculators saves a reduced-vocabulary
    DFlash and vLLM loads one (SGLang 0.5.23 serves only head target). Drafts only ids of that vocabulary; on large
    vocabularies it also cuts the head's share of each forward."""
    anchors_per_row: int = 16
    """Blocks trained per calibration row: anchor positions drawn (seeded by the row and step) among the positions
    whose next token is an assistant token (SpecForge draws up to 512 per sequence)."""
    next_round_anchors: bool = False
    """Also train, for each drawn anchor, the block where the next greedy round would start (after the block's
    leading agreeing rows and the target's token at its first miss; found by a forward without gradient): the
    positions rounds start from at inference, where a drafter's first row agrees least."""
    loss_decay: float = 7.0
    """gamma of the position weight exp(-(k - 1) / gamma) for block position k (SpecForge: 7 at B = 16; speculators:
    4 at B = 8)."""
    loss: str = "ce"
    """ce: cross-entropy to the row's own next token (SpecForge's block-wise CE; the rows are the target's own answers,
    so on a greedy calibration set that token is the target's argmax, what greedy verification accepts; on a sampled
    one its expectation is the kl loss); kl: soft cross-entropy to the target's distribution at each masked row
    (speculators' KL, the same gradient). On the kit ce lifts the held-out simulated tau from 4.84 to 5.96."""
    max_length: int = 256
    """Tokens kept per calibration row; at most the target's context (checked at plan time)."""
    eval_fraction: float = 0.05
    """Share of calibration conversations (by id hash) held out to score checkpoints by simulated tau."""
    eval_max_rows: int = 64
    """Most held-out rows scored per evaluation."""
    init_seed: int = 0
    """Seed of the drafter's initial weights."""
    train: TrainConfig = field(default_factory=_dflash_training)
    """Optimiser, schedule, batch, strategy (DeepSpeed ZeRO on GPUs, DDP or one process on CPU), checkpoints."""

    def __post_init__(self) -> None:
        check_value(self.num_layers >= 1, "train_dflash.num_layers", "an integer >= 1", self.num_layers)
        check_seed(self.init_seed, "train_dflash.init_seed")
        check_value(self.block_size >= 2, "train_dflash.block_size", "an integer >= 2", self.block_size)
        check_value(self.anchors_per_row >= 1, "train_dflash.anchors_per_row", "an integer >= 1", self.anchors_per_row)
        check_value(self.loss_decay > 0, "train_dflash.loss_decay", "a positive number", self.loss_decay)
        check_value(self.loss in DFLASH_LOSSES, "train_dflash.loss", " or ".join(DFLASH_LOSSES), self.loss)
        check_value(self.head in DFLASH_HEADS, "train_dflash.head", " or ".join(DFLASH_HEADS), self.head)
        check_value(self.num_attention_heads is None or self.num_attention_heads >= 1,
                    "train_dflash.num_attention_heads", "an integer >= 1 or null", self.num_attention_heads)
        check_value(self.intermediate_size is None or self.intermediate_size >= 1, "train_dflash.intermediate_size",
                    "an integer >= 1 or null", self.intermediate_size)
        check_value(self.num_key_value_heads is None or self.num_key_value_heads >= 1,
                    "train_dflash.num_key_value_heads", "an integer >= 1 or null", self.num_key_value_heads)
        check_value(self.max_length >= self.block_size + 1, "train_dflash.max_length",
                    f"at least block_size + 1 = {self.block_size + 1}", self.max_length)
        check_value(0 < self.eval_fraction < 1, "train_dflash.eval_fraction", "a number in (0, 1)", self.eval_fraction)
        check_value(self.eval_max_rows >= 1, "train_dflash.eval_max_rows", "an integer >= 1", self.eval_max_rows)
        check_value(self.target_layer_ids is None or len(self.target_layer_ids) >= 1, "train_dflash.target_layer_ids",
                    "a non-empty list of layer ids or null", self.target_layer_ids)
        check_value(self.mask_token_id is None or self.mask_token_id >= 0, "train_dflash.mask_token_id",
                    "a token id >= 0 or null", self.mask_token_id)


def check_target_layer_ids(ids: Any, num_target_layers: int) -> None:
    """Raise :class:`DrafterError` unless ``ids`` are ascending layer outputs in ``[0, num_target_layers − 2]``.

    The last layer's output (``L − 1``, HF ``output_hidden_states[L]``) is taken after the final norm, a feature no
    server hands a drafter: SGLang captures layer inputs up to layer ``L − 1`` only, and vLLM's capture at ``L`` is the
    residual before the norm. A drafter trained on it drafts from other features when served.
    """
    top = num_target_layers - 2
    ok = (isinstance(ids, (tuple, list)) and len(ids) >= 1 and all(isinstance(i, int) for i in ids)
          and all(0 <= i <= top for i in ids) and all(a < b for a, b in zip(ids, ids[1:])))
    if not ok:
        raise DrafterError(
            "DFlash target_layer_ids do not name target layers a serving engine hands over.",
            expected=f"distinct ascending layer outputs in [0, {top}] (reference numbering: id i reads "
                     f"output_hidden_states[i + 1]; the last layer's output, {num_target_layers - 1}, is taken after "
                     "the final norm, which no server captures)",
            found=f"target_layer_ids={ids!r} for a {num_target_layers}-layer target",
            fix="Leave target_layer_ids unset for the default, or pick increasing layer indices of the target below "
                f"{num_target_layers - 1}.")
