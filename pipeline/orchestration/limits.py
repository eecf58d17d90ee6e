"""Plan-time checks of the settings a model decides: context windows and EAGLE-3's trained draft length.

A config section refuses what its values alone make nonsense when it is read (a number that is not
finite, a draft length beyond :data:`~pipeline.config.stages.MAX_GAMMA`). Whether a length fits depends
on the models the config names, so :func:`check_settings` runs inside
:func:`~pipeline.orchestration.dag.plan`, for exactly the stages planned, before any stage does work.
Contexts come from the models' configs, a tiny-kit ref's from its recipe (nothing is built or loaded:
:func:`pipeline.models.context.context_length`); a model whose config names no context is not checked.
Each refusal is a :class:`~pipeline.errors.DrafterError` naming the keys, the sum and the limit.

What each stage must fit, in positions of the model that reads them:

* ``generate``: a row is the templated prompt (at most ``max_prompt_tokens``) and at most
  ``max_new_tokens`` answer tokens (``kind: raw`` keeps at most as many tokens of the dataset's turns), so
  ``max_prompt_tokens + max_new_tokens`` must fit the target, which reads every row in later stages, and
  the answering drafter for ``kind: drafter``. No row is then longer than the target's context.
* ``train_drafter`` and ``train_dflash``: ``max_length`` must fit the target, which computes the features of every
  kept position.
* ``train_router`` and ``estimate_rdk``: the rows they read (``max_length``, or generate's ``max_prompt_tokens +
  max_new_tokens`` where rows are shorter) must fit the drafter that reads them (``cluster.drafter``,
  ``evaluate.drafter``): a drafter's context can be shorter than the target's, and positions past it would be
  extrapolated without a word.
* ``evaluate``: a verify forward scores up to γ drafts and the position after them past the tokens kept,
  so the target and the same-tokenizer drafter must fit ``max_prompt_tokens + max_new_tokens +
  max(gammas) + 1``. (The loop drafts no further than ``max_new_tokens`` and so stays below this; the
  bound does not rely on it.) The other-tokenizer drafter is held to the same count of target tokens: it
  reads the same text in tokens of its own, a few more or fewer, so this is an estimate. The byte-level
  drafter reads bytes: at least one per target token (a text token spells one byte or more, a special is
  one drafter token), plus one round's string budget of ``max(gammas) x slrs_lookahead`` bytes (what
  ``slem_bytes`` drafts; SLRS enumerates ``slrs_lookahead`` bytes past each drafted token). That is a
  lower bound, so only a context that certainly cannot hold the text is refused; chat text averages
  about 2.4 bytes per token of the tiny kit's target (more with larger vocabularies), which is why the kit
  gives its byte drafter 3 to 2.5 times the target's context.
* ``evaluate`` with EAGLE-3: every γ must be at most the drafter's ``ttt_steps``. Its training-time test
  unrolls that many draft steps on its own outputs; a later step was never trained, so its drafts would
  measure an extrapolation, not the method. Refused rather than warned: a τ at such a γ would enter the
  report and the gate as EAGLE-3's. The steps come from ``train_drafter.ttt_steps``, or from the manifest
  of the artifact ``evaluate.eagle3`` names.
* ``evaluate`` with DFlash: every γ must be at most ``block_size − 1`` (one block's drafts), from
  ``train_dflash.block_size`` or the manifest of the artifact ``evaluate.dflash`` names.
* ``generate`` (but ``kind: raw``) and ``evaluate``: ``max_prompt_tokens`` must leave room for a token of the user's
  text under the target tokenizer's chat template (:func:`check_prompt_room`). The stage's own encoding refuses it
  too, but evaluate encodes its prompts after every trainer has run. A tiny-kit tokenizer is not checked here (planning
  never loads a kit), only by the stages.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from pipeline.artifacts import read_manifest
from pipeline.config.dflash import check_target_layer_ids
from pipeline.config.sections import PipelineConfig
from pipeline.data.sources import holds_humaneval, unseen_humaneval
from pipeline.engine.inputs import FrequencyInputs, RoutedInputs, ShortlistInputs
from pipeline.engine.methods import methods_reading, methods_with, models_read, stages_read
from pipeline.errors import DrafterError
from pipeline.models.context import context_length, depth, embedding_rows, tokenizer_too_large
from pipeline.models.loading import TINY_PREFIX, prompt_template_overhead
from pipeline.models.loading import fingerprint as model_fingerprint


def _context(cfg: PipelineConfig, name: str) -> int | None:

    target = name == cfg.target.model
    # target.trust_remote_code is the target's: a drafter named in the config never runs its own code
    return context_length(name, cfg.target.revision if target else None, target and cfg.target.trust_remote_code)


def _fit(keys: str, terms: list[int], needed: int, limit: int | None, model: str, unit: str, fix: str,
         why: str = "") -> None:
    """Refuse unless ``needed`` positions (``keys``, whose values are ``terms``) fit ``limit`` (None: no limit known)."""
    if limit is not None and needed > limit:
        numbers = " + ".join(str(t) for t in terms)
        raise DrafterError(
            f"{keys} ({numbers}) is longer than the context of {model}.",
            expected=f"{keys} <= {limit} {unit}, the context of {model}{why}",
            found=f"{numbers} = {needed} {unit}" if len(terms) > 1 else f"{needed} {unit}",
            fix=fix,
        )


def _check_generate(cfg: PipelineConfig) -> None:
    gen = cfg.generate
    models = [("target", cfg.target.model)] + ([("drafter", gen.drafter)] if gen.kind == "drafter" and gen.drafter else [])
    for role, name in models:
        limit = _context(cfg, name)
        room = (limit or 0) - gen.max_prompt_tokens
        _fit("generate.max_prompt_tokens + generate.max_new_tokens", [gen.max_prompt_tokens, gen.max_new_tokens],
             gen.max_prompt_tokens + gen.max_new_tokens, limit, f"the {role} {name}", "tokens",
             f"Lower generate.max_new_tokens to {room} or less." if room > 0 else
             f"Lower generate.max_prompt_tokens and generate.max_new_tokens to sum to {limit} or less.")


def _target_depth(cfg: PipelineConfig) -> int | None:
    return depth(cfg.target.model, cfg.target.revision, cfg.target.trust_remote_code)


def _check_train_drafter(cfg: PipelineConfig) -> None:
    td = cfg.train_drafter
    limit = _context(cfg, cfg.target.model)
    _fit("train_drafter.max_length", [td.max_length], td.max_length, limit, f"the target {cfg.target.model}",
         "tokens", f"Set train_drafter.max_length to {limit} or less.")
    layers = _target_depth(cfg) if td.aux_layer_ids else None
    if layers is not None and not all(0 <= i < layers for i in td.aux_layer_ids):  # the export refuses L
        raise DrafterError(
            "train_drafter.aux_layer_ids name hidden states a serving engine does not hand a drafter.",
            expected=f"indices into output_hidden_states in [0, {layers - 1}] (index {layers} is taken after the "
                     "final norm: SGLang never captures it, vLLM captures the residual before the norm; the target has "
                     "none beyond it)",
            found=f"aux_layer_ids={td.aux_layer_ids} for the {layers}-layer target {cfg.target.model}",
            fix="Leave train_drafter.aux_layer_ids unset for the default, or pick indices below the target's depth.")


def _check_train_dflash(cfg: PipelineConfig) -> None:
    tc = cfg.train_dflash
    limit = _context(cfg, cfg.target.model)
    _fit("train_dflash.max_length", [tc.max_length], tc.max_length, limit, f"the target {cfg.target.model}",
         "tokens", f"Set train_dflash.max_length to {limit} or less.")
    layers = _target_depth(cfg) if tc.target_layer_ids else None
    if layers is not None:
        check_target_layer_ids(list(tc.target_layer_ids), layers)


def _rows_read(cfg: PipelineConfig, key: str, max_length: int, override: str | None) -> tuple[str, int]:
    """What a stage that cuts calibration rows to ``max_length`` (config key ``key``) reads at most, and which keys
    say so: ``max_length``, or generate's ``max_prompt_tokens + max_new_tokens`` where rows are no longer than that
    (those of the artifact ``override`` names, when set; its manifest holds its generate section)."""
    gen = cfg.generate.__dict__
    if override:
        gen = read_manifest(Path(override).expanduser().resolve(), kind="calibration").get("config", {}).get(
            "generate", {})
    try:
        bound = int(gen["max_prompt_tokens"]) + int(gen["max_new_tokens"])
    except (KeyError, TypeError, ValueError):
        return key, max_length
    if bound < max_length:
        return "the calibration rows (generate.max_prompt_tokens + generate.max_new_tokens)", bound
    return key, max_length


def _check_train_router(cfg: PipelineConfig) -> None:
    tr, name = cfg.train_router, cfg.cluster.drafter
    keys, needed = _rows_read(cfg, "train_router.max_length", tr.max_length, tr.calibration)
    limit = _context(cfg, name)
    _fit(keys, [needed], needed, limit, f"the drafter {name} (cluster.drafter), which reads every row", "tokens",
         f"Set train_router.max_length to {limit} or less, or pick a cluster.drafter with a longer context.")


def _check_estimate_rdk(cfg: PipelineConfig) -> None:
    er, name = cfg.estimate_rdk, cfg.evaluate.drafter
    keys, needed = _rows_read(cfg, "estimate_rdk.max_length", er.max_length, er.calibration)
    limit = _context(cfg, name)
    _fit(keys, [needed], needed, limit, f"the drafter {name} (evaluate.drafter), which reads the held-out rows",
         "tokens", f"Set estimate_rdk.max_length to {limit} or less, or pick an evaluate.drafter with a longer "
                   "context.")
    check_rdk_code_problems(cfg)


def _block_size(cfg: PipelineConfig) -> int | None:
    """The block size of the evaluated DFlash drafter (None when its artifact does not say)."""
    if not cfg.evaluate.dflash:
        return cfg.train_dflash.block_size
    manifest = read_manifest(Path(cfg.evaluate.dflash).expanduser().resolve(), kind="dflash_drafter")
    size = manifest.get("config", {}).get("train_dflash", {}).get("block_size")
    return size if isinstance(size, int) else None


def _ttt_steps(cfg: PipelineConfig) -> int | None:
    """The draft steps the evaluated EAGLE-3 drafter was trained for (None when its artifact does not say)."""
    if not cfg.evaluate.eagle3:
        return cfg.train_drafter.ttt_steps

    manifest = read_manifest(Path(cfg.evaluate.eagle3).expanduser().resolve(), kind="eagle3_drafter")
    steps = manifest.get("config", {}).get("train_drafter", {}).get("ttt_steps")
    return steps if isinstance(steps, int) else None


def _using(cfg: PipelineConfig, need: str) -> str:
    """The evaluated methods that load drafter ``need`` or read stage ``need``'s artifact (from the registry)."""

    return ", ".join(methods_reading(cfg.evaluate.methods, need))


def _check_shortlist_names(cfg: PipelineConfig, static: list[str]) -> None:
    """Refuse ``evaluate.shortlists`` or ``evaluate.dynaspec_match`` naming a shortlist count will not build (a typo,
    ``a,b`` for ``[a, b]``): found out in evaluate only, after every trainer."""
    built, ev = cfg.count.shortlist_names(), cfg.evaluate
    matched = [m for m in ev.methods if m in methods_with(RoutedInputs) or m in methods_with(FrequencyInputs)]
    asked = {"evaluate.shortlists": ev.shortlists if static else [],
             "evaluate.dynaspec_match": [ev.dynaspec_match] if matched else []}
    for key, names in asked.items():
        if unknown := [name for name in names if name not in built]:
            raise DrafterError(f"{key} names shortlists count will not build: {', '.join(map(repr, unknown))}.",
                               expected=f"names from count.top_k, count.top_p and count.min_count: {built}",
                               found=repr(names), fix=f"Pick {key} among those (a list is written [a, b]), or add the "
                                                     "size to count.top_k, count.top_p or count.min_count.")


def _check_evaluate(cfg: PipelineConfig) -> None:

    ev = cfg.evaluate
    if "chat" in ev.tasks and cfg.generate.heldout_fraction == 0:  # found out only after every trainer, otherwise
        raise DrafterError("evaluate.tasks has chat, but generate.heldout_fraction is 0: no chat is held out of the "
                           "calibration set to evaluate on.", expected="generate.heldout_fraction > 0 (e.g. 0.05)",
                           found="generate.heldout_fraction=0",
                           fix="Hold out a share of the chats (generate.heldout_fraction=0.05), or evaluate.tasks=[code].")
    static = [m for m in ev.methods if m in methods_with(ShortlistInputs)]  # one row per named shortlist
    if static and not ev.shortlists:
        raise DrafterError("Set evaluate.shortlists.", expected=f"at least one shortlist name when method "
                           f"{', '.join(static)} is on", found=repr(ev.shortlists),
                           fix="Name shortlists of the count artifact (top_k_<k>, top_p_<p>, ...) or drop the method.")
    if ev.counts is None:  # count builds from this config: its shortlists' names are known before any stage runs
        _check_shortlist_names(cfg, static)
    gamma = max(ev.gammas)
    drafters, stages = models_read(ev.methods), stages_read(ev.methods)
    models = [("target", cfg.target.model)]
    models += [("drafter", ev.drafter)] if "drafter" in drafters else []
    models += [("drafter_other", ev.drafter_other)] if "drafter_other" in drafters and ev.drafter_other else []
    for role, name in models:
        limit = _context(cfg, name)
        room = (limit or 0) - ev.max_prompt_tokens - gamma - 1
        _fit("evaluate.max_prompt_tokens + evaluate.max_new_tokens + max(evaluate.gammas) + 1",
             [ev.max_prompt_tokens, ev.max_new_tokens, gamma, 1], ev.max_prompt_tokens + ev.max_new_tokens + gamma + 1,
             limit, f"the {role} {name}", "tokens",
             (f"Lower evaluate.max_new_tokens to {room} or less" if room > 0 else
              "Lower evaluate.max_prompt_tokens, evaluate.max_new_tokens or evaluate.gammas")
             + ("" if role == "target" else f", or pick an evaluate.{role} with a longer context") + ".")
    if "drafter_bytes" in drafters and ev.drafter_bytes:
        _fit("evaluate.max_prompt_tokens + evaluate.max_new_tokens + max(evaluate.gammas) x evaluate.slrs_lookahead",
             [ev.max_prompt_tokens, ev.max_new_tokens, gamma * ev.slrs_lookahead],
             ev.max_prompt_tokens + ev.max_new_tokens + gamma * ev.slrs_lookahead, _context(cfg, ev.drafter_bytes),
             f"the byte-level drafter_bytes {ev.drafter_bytes}", "bytes",
             "Lower evaluate.max_prompt_tokens, evaluate.max_new_tokens, evaluate.gammas or evaluate.slrs_lookahead, "
             f"pick an evaluate.drafter_bytes with a longer context, or drop {_using(cfg, 'drafter_bytes')} from "
             "evaluate.methods.",
             " (a target token spells at least one byte, and a round drafts up to gamma x slrs_lookahead bytes; "
             "chat text averages more, about 2.4 bytes per token of the tiny kit's target)")
    if "train_drafter" in stages and (steps := _ttt_steps(cfg)) is not None and gamma > steps:
        where = f"ttt_steps of the artifact {cfg.evaluate.eagle3}" if cfg.evaluate.eagle3 else "train_drafter.ttt_steps"
        raise DrafterError(
            "evaluate.gammas asks the EAGLE-3 drafter for more draft steps than it was trained to make.",
            expected=f"every evaluate.gammas entry <= {steps} ({where}: the training-time test's "
                     f"unrolled draft steps)",
            found=f"evaluate.gammas={ev.gammas}",
            fix=f"Drop the gammas above {steps} from evaluate.gammas, train the drafter with "
                f"train_drafter.ttt_steps={gamma} or more, or drop {_using(cfg, 'train_drafter')} from evaluate.methods.",
        )


    if "train_dflash" in stages and (size := _block_size(cfg)) is not None and gamma > size - 1:
        raise DrafterError(
            "evaluate.gammas asks the DFlash drafter for more drafts than one block holds.",
            expected=f"every evaluate.gammas entry <= block_size - 1 = {size - 1}",
            found=f"evaluate.gammas={ev.gammas}",
            fix=f"Drop the gammas above {size - 1}, train with train_dflash.block_size={gamma + 1} or more, or drop "
                f"{_using(cfg, 'train_dflash')} from evaluate.methods.",
        )


def check_rdk_code_problems(cfg: PipelineConfig, unseen: int | None = None) -> None:
    """Refuse an RDK code analysis that would take HumanEval problems the evaluation decodes or the calibration set
    was drawn from: RDK takes the last ``estimate_rdk.code_problems`` of the problems no calibration row holds
    (:func:`~pipeline.data.sources.unseen_humaneval`), the evaluation the first ``evaluate.prompts_per_task``. Checked
    whenever a plan holds estimate_rdk, built or reused: the evaluation's settings are not in its id. A plan reads no
    dataset: it counts every problem a source other than HumanEval may leave unseen; the stage checks again with
    ``unseen``, the problems it found unseen with the source read."""
    er, ev, gen = cfg.estimate_rdk, cfg.evaluate, cfg.generate
    if not er.code_problems:
        return
    if unseen is None:
        unseen = len(unseen_humaneval(gen.source, gen.heldout_fraction, read_source=False))
    decoded = ev.prompts_per_task if "code" in ev.tasks else 0
    if er.code_problems + decoded > unseen:
        drew = "; the calibration set drew on the others" if holds_humaneval(gen.source) else ""
        raise DrafterError("RDK's code analysis would reuse HumanEval problems that evaluate decodes or the calibration "
                           "set was drawn from.",
                           expected=f"estimate_rdk.code_problems + evaluate.prompts_per_task <= {unseen} "
                                    f"(the problems no calibration row holds{drew})",
                           found=f"{er.code_problems} + {decoded}",
                           fix="Lower estimate_rdk.code_problems (0 skips the code analysis)"
                               + (" or raise generate.heldout_fraction." if drew else "."))


_CHECKS = {"generate": _check_generate, "train_drafter": _check_train_drafter, "train_dflash": _check_train_dflash,
           "train_router": _check_train_router, "evaluate": _check_evaluate, "estimate_rdk": _check_estimate_rdk}


def check_tokenizer_fits(cfg: PipelineConfig, tokenizer_size: int | None) -> None:
    """Refuse a ``target.tokenizer`` with more ids than the target's embedding has rows: its high ids would index
    past the embedding (a raw IndexError, or a CUDA assert, deep in generate). Fewer ids is the usual padded
    embedding. Checked only for a tokenizer named apart from the model (the model's own always fits)."""
    if not cfg.target.tokenizer or cfg.target.tokenizer == cfg.target.model or tokenizer_size is None:
        return
    rows = embedding_rows(cfg.target.model, cfg.target.revision, cfg.target.trust_remote_code)
    if rows is not None and tokenizer_size > rows:
        raise tokenizer_too_large(cfg.target.tokenizer, cfg.target.model, tokenizer_size, rows)


def check_prompt_room(cfg: PipelineConfig, stages: Collection[str]) -> None:
    """Refuse a ``generate.max_prompt_tokens`` (a ``kind`` that templates prompts) or ``evaluate.max_prompt_tokens``
    that the target tokenizer's chat template fills by itself: no prompt could hold a token of the user's text."""
    settings = ([("generate.max_prompt_tokens", cfg.generate.max_prompt_tokens)]
                if "generate" in stages and cfg.generate.kind != "raw" else [])
    settings += [("evaluate.max_prompt_tokens", cfg.evaluate.max_prompt_tokens)] if "evaluate" in stages else []
    name = cfg.target.tokenizer or cfg.target.model
    if not settings or (overhead := prompt_template_overhead(name, cfg.target.revision,
                                                             cfg.target.trust_remote_code)) is None:
        return
    for key, value in settings:
        if value <= overhead:
            raise DrafterError(f"{key}={value} leaves no room for the user's text under {name}'s chat template.",
                               expected=f"{key} of at least {overhead + 1}: the template's {overhead} tokens around a "
                                        "user turn and one token of its text",
                               found=f"{key}={value}",
                               fix=f"Raise {key} to well above {overhead} (the default is 128).")


def check_settings(cfg: PipelineConfig, stages: Collection[str], fingerprint: dict) -> None:
    """Refuse settings that do not fit the models of ``stages`` (the stages a plan will build or reuse), or a
    tokenizer that does not fit the target (its ``fingerprint`` holds the tokenizer's size).

    Raises:
        DrafterError: A length beyond a model's context, or a γ beyond the EAGLE-3 drafter's ``ttt_steps``;
            the message names the keys, the sum and the limit (see the module docstring). A ``target.tokenizer``
            with more ids than the target's embedding.
    """
    check_tokenizer_fits(cfg, fingerprint.get("vocab_size"))
    check_prompt_room(cfg, stages)
    for name in stages:
        if name in _CHECKS:
            _CHECKS[name](cfg)
    if "estimate_rdk" in stages:
        check_same_tokenizer(cfg.evaluate.drafter, "evaluate.drafter", fingerprint.get("vocab_hash"), "estimate_rdk")


def check_same_tokenizer(drafter: str, key: str, target_hash: str | None, stage: str) -> None:
    """Refuse a drafter that a stage reads as sharing the target's tokenizer (its distributions indexed by target ids)
    whose vocabulary hash differs from the target's (``target_hash``; None: not known, nothing checked). The hash of
    a tiny-kit tokenizer (named by its recipe) and that of any other one (named by its tokens) are not comparable:
    such a pair is left to the stage, which compares the tokenizers themselves before its work."""
    if not target_hash or target_hash.startswith(TINY_PREFIX) != drafter.startswith(TINY_PREFIX):
        return
    drafter_hash = model_fingerprint(drafter).get("vocab_hash")  # the plan's own fingerprint of it: cached
    if drafter_hash and drafter_hash != target_hash:
        raise not_same_tokenizer(drafter, key, target_hash, drafter_hash, stage)


def not_same_tokenizer(drafter: str, key: str, target_hash: str, drafter_hash: str, stage: str) -> DrafterError:
    """The error for a same-tokenizer drafter (config key ``key``) whose vocabulary is not the target's."""
    return DrafterError(f"{stage} reads the drafter {drafter!r} ({key}) as sharing the target's tokenizer (its "
                        "distributions indexed by target token ids), but its vocabulary is another one.",
                        expected=f"vocab_hash {target_hash[:32]} (the target's)",
                        found=f"vocab_hash {drafter_hash[:32]}",
                        fix=f"Set {key} to a drafter with the target's tokenizer (a different-tokenizer drafter "
                            "belongs in evaluate.drafter_other).")
