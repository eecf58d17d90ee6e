"""``drafter bench decode``: where a speculative round's time goes, against the bare forwards it runs and against
autoregressive decoding, measured in one run on one device.

For each method and γ the decode loop runs on the bench's prompts (greedy, on the decode path the device would
use, after a warm-up generation), and the round is split into **draft** (the proposer), **verify** (the target's
forward of γ + 1 tokens, standardising, verification and the round's one host read) and **the rest** (the loop's
bookkeeping). The **bare forwards** a round runs are timed alone, each a median over all its samples: the target's
forward of γ + 1 tokens, its one-token forward, and the drafter's forwards and heads of one round (a chain drafter: a
catch-up of the accepted tokens and γ − 1 one-token steps, γ heads; DFlash: one block forward over as many new
context rows and its B − 1 head rows; logits, not standardised, for both). Everything a row divides is measured
paired in time: per prompt, autoregressive decoding, then the method's decoding, then a few samples of each bare
forward in turn, so a load that comes and goes on a shared machine weighs on numerator and denominator alike (timed
one after the other, a busy 2-core host moved the engine overhead of one method between 1.04× and 1.56× from run to
run). From them:

* **engine overhead** = round time ÷ (bare draft + bare verify): 1.0 would be an engine that adds nothing;
* **measured speedup**, end to end (tokens/s ÷ autoregressive tokens/s on the same prompts, prefills included) and
  per round (``τ × t_token ÷ round time``, ``t_token`` an autoregressive token after the first: prefills left out);
* **Leviathan's prediction** from the measured cost and acceptance: ``E[tokens per round](α, γ) × t_AR ÷ (bare draft
  + bare verify)`` (Leviathan et al. 2023, Thm. 3.8, with ``c`` and the verify cost measured instead of assumed),
  with ``α`` the per-draft acceptance of the run and ``t_AR`` the bare one-token forward; it is a per-round figure,
  so the per-round speedup is what it is held against.

Two shapes: ``tiny`` (the kit's trained target, drafter and, when built, EAGLE-3 and DFlash drafters: real
acceptance) and ``llama3-8b`` (random weights in bf16 at the shapes of Llama-3.1-8B, Llama-3.2-1B, the EAGLE-3 and
DFlash heads of ``configs/llama3-8b.yaml`` and a DynaSpec head over the 1B drafter's rows: acceptance is
meaningless, so those rows report time per round and the speedup **projected** for the acceptance this bench
measured on the kit for the same method and γ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from pipeline.drafters.dflash import DFlashConfig, DFlashDrafter
from pipeline.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from pipeline.dynaspec.budget import ClusterBudget, ShortlistPolicy
from pipeline.dynaspec.clusters import Clustering
from pipeline.dynaspec.router import Router
from pipeline.engine.bench import unbalanced_assignment
from pipeline.engine.dflash import DFlashProposer
from pipeline.engine.eagle3 import Eagle3Proposer
from pipeline.engine.inputs import BlockFeatureInputs, FeatureInputs, RoutedInputs, SameTokenizerInputs
from pipeline.engine.loop import GenerationResult, generate_autoregressive, generate_speculative
from pipeline.engine.methods import DECODE_BENCH, METHODS, build_proposer
from pipeline.engine.metrics import expected_tokens_per_round, summarize
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.session import TargetState
from pipeline.engine.static import DecodeOptions, decode_capacity, session_for
from pipeline.progress import heartbeat
from pipeline.timing import CacheFlusher, device_name, interleaved_times, median_seconds
from pipeline.vocab.counting import eagle3_offset_maps

GREEDY = SamplingParams()


@dataclass
class DecodeRow:
    """One method × γ on one shape and device (milliseconds; ratios plain)."""

    shape: str
    device: str
    path: str
    method: str
    gamma: int
    rounds: int
    tau: float
    alpha: float | None
    round_ms: float
    draft_ms: float
    verify_ms: float
    rest_ms: float
    bare_draft_ms: float | None
    bare_verify_ms: float
    bare_ar_ms: float
    tokens_per_s: float
    ar_tokens_per_s: float
    ar_token_ms: float
    alpha_used: float | None = None
    notes: list[str] = field(default_factory=list)
    bare_samples: int = 0
    """Timed calls behind each bare forward's median (the table prints it: a median of 2 is not one of 200)."""

    @property
    def bare_round_ms(self) -> float | None:
        return None if self.bare_draft_ms is None else self.bare_draft_ms + self.bare_verify_ms

    @property
    def overhead(self) -> float | None:
        """Round time over the bare forwards it runs (1.0: no engine cost)."""
        bare = self.bare_round_ms
        return None if bare is None else self.round_ms / bare

    @property
    def speedup(self) -> float:
        """End to end (prefills and first tokens included): tokens/s over autoregressive tokens/s."""
        return self.tokens_per_s / self.ar_tokens_per_s

    @property
    def steady_speedup(self) -> float:
        """Per round against per autoregressive token, prefills left out: what Leviathan's formula predicts."""
        return self.tau * self.ar_token_ms / self.round_ms

    @property
    def predicted(self) -> float | None:
        """Leviathan's expected speedup from the measured acceptance and bare costs."""
        alpha = self.alpha_used if self.alpha_used is not None else self.alpha
        bare = self.bare_round_ms
        if alpha is None or bare is None:
            return None
        return expected_tokens_per_round(alpha, self.gamma) * self.bare_ar_ms / bare

    @property
    def projected(self) -> float | None:
        """At random weights: the kit's acceptance over the measured round time, against the bare AR forward."""
        if self.alpha_used is None:
            return None
        return expected_tokens_per_round(self.alpha_used, self.gamma) * self.bare_ar_ms / self.round_ms


# --- the bare forwards of a round ---------------------------------------------------------------------------


def _ids(n: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).to(device)


def bare_target(target: torch.nn.Module, options: DecodeOptions, layers: Sequence[int], length: int, n: int
                ) -> Callable[[], Any]:
    """The target's forward of ``n`` device-fed tokens after ``length`` cached ones, rolled back after each call."""
    session = session_for(target, options, layers=layers)
    vocab = int(target.config.vocab_size)
    session.feed(_ids(length, vocab, session.device).tolist())
    fed = _ids(n, vocab, session.device, 1)

    def run() -> Any:
        out = session.feed(fed, n)
        session.crop(length)
        return out

    return run


def bare_drafter(proposer: Any, target: torch.nn.Module, options: DecodeOptions, length: int, gamma: int,
                 catch_up: int) -> Callable[[], Any] | None:
    """A round's drafter forwards and heads alone, for the proposer families the engine runs on the device: an HF
    drafter's body (``catch_up`` tokens, then ``gamma − 1`` single tokens) with its head per step; EAGLE-3's steps
    and draft-vocabulary heads; DFlash's block forward and its head rows. None for other proposers."""

    vocab = int(target.config.vocab_size)
    prepare = getattr(proposer, "prepare", None)
    if prepare is not None:
        prepare(options)
    if isinstance(proposer, Eagle3Proposer):
        return _bare_eagle3(proposer, length, gamma, catch_up, vocab)
    if isinstance(proposer, DFlashProposer):
        return _bare_dflash(proposer, length, catch_up)
    head = getattr(proposer, "head", None) or getattr(proposer, "routed", None)
    session = getattr(proposer, "session", None)
    if head is None or session is None:
        return None
    proposer.reset()
    session.feed(_ids(length, vocab, session.device).tolist())
    first, steps = _ids(catch_up, vocab, session.device, 1), _ids(gamma, vocab, session.device, 2)
    routed = getattr(proposer, "routed", None)
    clusters = None
    if routed is not None:  # DynaSpec: the router and the routed head per step
        k = proposer.budget.at(0) if not isinstance(proposer.budget, dict) else next(iter(proposer.budget.values())).at(0)
        width = proposer.embed.weight.shape[1]
        clusters = torch.arange(k, device=session.device)

    def run() -> Any:
        row = session.feed(first, catch_up)[-1]
        for step in range(gamma):
            if routed is not None:
                proposer._route(steps[step : step + 1], row[:width], k)
                out = routed.shortlist(row, clusters).logits
            else:
                out = head(row)
            if step + 1 < gamma:
                row = session.feed(steps[step : step + 1])[-1]
        session.crop(length)
        return out

    return run


def _bare_eagle3(proposer: Any, length: int, gamma: int, catch_up: int, vocab: int) -> Callable[[], Any]:
    drafter = proposer.drafter
    weight = drafter.fc.weight
    proposer.reset()
    width = drafter.config.hidden_size
    features = torch.randn(1, length, 3 * width, generator=torch.Generator().manual_seed(0)).to(weight)
    ids = _ids(length, vocab, weight.device).unsqueeze(0)
    proposer._run(ids, features)
    new = torch.randn(1, catch_up, 3 * width, generator=torch.Generator().manual_seed(1)).to(weight)
    new_ids = _ids(catch_up, vocab, weight.device, 1).unsqueeze(0)
    token = _ids(1, vocab, weight.device, 2).view(1, 1)

    def run() -> Any:
        out = proposer._run(new_ids, new)[:, -1:]
        for step in range(gamma):
            logits = drafter.logits(out[0, -1])
            if step + 1 < gamma:
                out = proposer._run(token, out)
        proposer.cache.crop(length)
        return logits

    return run


def _bare_dflash(proposer: Any, length: int, catch_up: int) -> Callable[[], Any]:
    drafter = proposer.drafter
    weight = drafter.fc.weight
    taps = len(drafter.config.target_layer_ids)
    total = length + catch_up  # context rows after the round: the cached ones and the round's new ones
    hidden = [torch.randn(total, drafter.config.hidden_size, generator=torch.Generator().manual_seed(i)).to(weight)
              for i in range(taps)]
    ids = _ids(total + 1, int(drafter.config.vocab_size), weight.device)
    context, state = ids.tolist(), TargetState(token_ids=ids)
    proposer.reset()
    proposer.block_logits(context[: length + 1], [h[:length] for h in hidden], state)

    def run() -> Any:
        # as EAGLE-3's bare steps: the forward over the round's catch_up new context rows and the block, and the head
        # rows (no standardising: the chain drafters' bare steps have none either); then the cache back to length
        out = proposer.block_logits(context, hidden, state)
        proposer.cache.crop(length)
        proposer._ids = context[:length]
        return out

    return run


def _bare_context(prompts: list[list[int]], new_tokens: int, gamma: int, options: DecodeOptions
                  ) -> tuple[int, DecodeOptions]:
    """Where the bare forwards run: the rounds' mean context length (the mean prompt plus half the new tokens), and
    ``options`` with a static capacity for the longest prompt's generation at ``gamma``."""
    length = round(sum(len(p) for p in prompts) / len(prompts)) + new_tokens // 2
    return length, replace(options, capacity=decode_capacity(max(len(p) for p in prompts), new_tokens, gamma, 64))


def verify_curve(target: torch.nn.Module, prompts: list[list[int]], new_tokens: int, most: int,
                 options: DecodeOptions, repeats: int = 20, cold: bool = False) -> dict[int, float]:
    """Milliseconds of the target's forward of ``n`` device-fed tokens, ``n = 1 .. most`` (a round verifying
    ``n − 1`` drafts), after the bench's context length, each a median of ``repeats`` calls timed in turn (after a
    cache eviction each with ``cold``). How the verify cost grows with the drafts verified decides what cutting a
    block short could save: where it is flat, nothing."""
    device = target.get_input_embeddings().weight.device
    length, sized = _bare_context(prompts, new_tokens, most - 1, options)
    fns = {str(n): bare_target(target, sized, (), length, n) for n in range(1, most + 1)}
    times = interleaved_times(fns, device, repeats, warmup=1, before=CacheFlusher(device) if cold else None)
    return {int(n): 1e3 * float(np.median(seconds)) for n, seconds in times.items()}


def verify_curve_line(shape: str, curve: dict[int, float]) -> str:
    """``verify_curve`` as one line of the bench's output: each count's ms and its ratio to one token's."""
    one = curve[1]
    cells = ", ".join(f"{n}: {ms:.3f} ({ms / one:.2f}×)" for n, ms in sorted(curve.items()))
    return f"{shape}: the target's forward by tokens fed (a round verifying n − 1 drafts), ms: {cells}."


# --- one method × γ --------------------------------------------------------------------------------------------


def _rounds_time(results: list[GenerationResult]) -> tuple[int, float, float, float]:
    """(rounds, round seconds, draft seconds, verify seconds) of the rounds, prefills left out."""
    rounds = sum(len(r.accepted_per_round) for r in results)
    wall = sum(r.wall_seconds - r.prefill_seconds for r in results)
    draft = sum(r.drafter_seconds for r in results)
    verify = sum(r.target_seconds - r.prefill_seconds for r in results)
    return rounds, wall, draft, verify


def measure(shape: str, target: torch.nn.Module, proposers: dict[str, Any], prompts: list[list[int]],
            gammas: Sequence[int], new_tokens: int, options: DecodeOptions, repeats: int = 20,
            kit_alpha: dict[tuple[str, int], float] | None = None, log: Callable[[str], None] = print,
            eos: int | None = None, cold: bool = False) -> list[DecodeRow]:
    """Every method × γ of ``proposers`` against autoregressive decoding on ``prompts`` (see the module docstring).

    Args:
        kit_alpha: ``(method, γ)`` → the acceptance measured on the kit: rows then carry the projected speedup.
        cold: Time each bare forward after evicting the device's caches (:class:`~pipeline.timing.CacheFlusher`), as a
            round meets it after the other model's forward; else back to back, where small weights stay cached.
    """
    device = target.get_input_embeddings().weight.device
    name = device_name(device)
    length, sized = _bare_context(prompts, new_tokens, max(gammas), options)

    def generate(proposer: Any, gamma: int, prompt: list[int]) -> GenerationResult:
        if proposer is None:
            return generate_autoregressive(target, prompt, new_tokens, GREEDY, torch.Generator(device=device), eos,
                                           sized)
        return generate_speculative(target, proposer, prompt, new_tokens, gamma, GREEDY,
                                    torch.Generator(device=device), eos, sized)

    for prompt in prompts:  # warm-up (graphs captured, allocator grown)
        generate(None, 0, prompt)
    ar = summarize([generate(None, 0, p) for p in prompts])
    bare_ar = 1e3 * median_seconds(bare_target(target, sized, (), length, 1), device, repeats)
    log(f"bench decode {shape}: autoregressive {ar.tokens_per_second:.1f} tokens/s, bare one-token forward "
        f"{bare_ar:.3f} ms")
    per_prompt = max(1, math.ceil(repeats / len(prompts)))
    flush = CacheFlusher(device) if cold else None
    rows = []
    for method, proposer in proposers.items():
        layers = tuple(proposer.target_layers)
        for gamma in gammas:
            warm = [generate(proposer, gamma, p) for p in prompts]  # warm-up; its τ sizes the bare catch-up
            catch_up = max(1, round(summarize(warm).mean_accepted_length or 1))
            # Paired in time: per prompt, autoregressive decoding, the method's decoding, then its bare forwards
            # (timed in turn), so a load that comes and goes on a shared machine weighs on all of them alike.
            paired_ar, results, bare = [], [], {"verify": [], "draft": [], "ar": []}
            for prompt in prompts:
                paired_ar.append(generate(None, 0, prompt))
                results.append(generate(proposer, gamma, prompt))
                # rebuilt after each generation, which resets the sessions and drafter caches they run in
                fns = {"verify": bare_target(target, sized, layers, length, gamma + 1),
                       "ar": bare_target(target, sized, (), length, 1)}
                if (draft_fn := bare_drafter(proposer, target, sized, length, gamma, catch_up)) is not None:
                    fns["draft"] = draft_fn
                for key, seconds in interleaved_times(fns, device, per_prompt, warmup=1, before=flush).items():
                    bare[key] += seconds
            metrics, ar_metrics = summarize(results, paired_ar), summarize(paired_ar)
            rounds, wall, draft, verify = _rounds_time(results)
            bare_draft = 1e3 * float(np.median(bare["draft"])) if bare["draft"] else None
            row = DecodeRow(shape, name, sized.path, method, gamma, rounds, metrics.mean_accepted_length or 1.0,
                            metrics.verified_acceptance_rate, 1e3 * wall / rounds, 1e3 * draft / rounds,
                            1e3 * verify / rounds, 1e3 * (wall - draft - verify) / rounds, bare_draft,
                            1e3 * float(np.median(bare["verify"])), 1e3 * float(np.median(bare["ar"])),
                            metrics.tokens_per_second or 0.0, ar_metrics.tokens_per_second, ar_metrics.tpot_ms)
            row.bare_samples = min(len(samples) for samples in bare.values() if samples)
            if kit_alpha is not None:
                row.alpha_used = kit_alpha.get((method, gamma))
            rows.append(row)
            log(f"bench decode {shape}: {method} γ={gamma} round {row.round_ms:.3f} ms (draft {row.draft_ms:.3f}, "
                f"verify {row.verify_ms:.3f}, rest {row.rest_ms:.3f}), overhead "
                f"{_x(row.overhead)}, speedup {row.speedup:.2f}×")
    return rows


def _x(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}×"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def decode_table(rows: list[DecodeRow]) -> str:
    """The bench's Markdown table: measured rows (real acceptance), then projected ones (random weights)."""
    lines = ["| shape | device | path | method | γ | τ | α | round ms | draft / verify / rest ms | "
             "bare draft + verify ms (n) | engine overhead | tokens/s (AR) | speedup end to end | per round | "
             "Leviathan predicted | per round ÷ predicted |", "|---" * 16 + "|"]
    for r in rows:
        if r.shape != "tiny":  # random weights: in the projected table below
            continue
        ratio = None if r.predicted is None else r.steady_speedup / r.predicted
        lines.append(f"| {r.shape} | {r.device} | {r.path} | {r.method} | {r.gamma} | {r.tau:.2f} | "
                     f"{'—' if r.alpha is None else f'{r.alpha:.2f}'} | {r.round_ms:.3f} | {r.draft_ms:.3f} / "
                     f"{r.verify_ms:.3f} / {r.rest_ms:.3f} | {_ms(r.bare_draft_ms)} + {r.bare_verify_ms:.3f} "
                     f"(n {r.bare_samples}) | {_x(r.overhead)} | {r.tokens_per_s:.1f} ({r.ar_tokens_per_s:.1f}) | "
                     f"{r.speedup:.2f}× | {r.steady_speedup:.2f}× | {_x(r.predicted)} | {_x(ratio)} |")
    projected = [r for r in rows if r.shape != "tiny"]
    if projected:
        lines += ["", "Random weights (acceptance meaningless): time per round, and the speedup **projected** for the "
                  "acceptance measured on the kit (same method and γ) over this shape's measured round and bare "
                  "one-token forward.", "",
                  "| shape | device | path | method | γ | round ms | draft / verify / rest ms | "
                  "bare draft + verify ms (n) | engine overhead | bare AR forward ms | α (kit) | projected speedup |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in projected:
            lines.append(f"| {r.shape} | {r.device} | {r.path} | {r.method} | {r.gamma} | {r.round_ms:.3f} | "
                         f"{r.draft_ms:.3f} / {r.verify_ms:.3f} / {r.rest_ms:.3f} | {_ms(r.bare_draft_ms)} + "
                         f"{r.bare_verify_ms:.3f} (n {r.bare_samples}) | {_x(r.overhead)} | {r.bare_ar_ms:.3f} | "
                         f"{'—' if r.alpha_used is None else f'{r.alpha_used:.2f}'} | "
                         f"{'— (no kit row)' if r.projected is None else f'{r.projected:.2f}× (projected)'} |")
    return "\n".join(lines)



# --- the llama3-8b shape -------------------------------------------------------------------------------------

LLAMA_3_1_8B = {"vocab_size": 128_256, "hidden_size": 4096, "intermediate_size": 14_336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}}
"""Llama-3.1-8B's shape (its config.json; the weights here are random)."""
LLAMA_3_2_1B = {**LLAMA_3_1_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "head_dim": 64, "tie_word_embeddings": True}
"""Llama-3.2-1B's shape: the same-tokenizer drafter."""
LLAMA_DRAFT_VOCAB = 32_768
"""The draft vocabulary at Llama-3.1-8B's shape: ``configs/llama3-8b.yaml``'s ``count.draft_vocab_size``."""


def scaled_shape(shape: dict, scale: int) -> dict:
    """``shape`` with widths and vocabulary divided by ``scale`` (heads kept), for a smoke run on a CPU."""
    if scale == 1:
        return dict(shape)
    out = dict(shape)
    for key in ("vocab_size", "hidden_size", "intermediate_size"):
        out[key] = max(8, shape[key] // scale)
    out["head_dim"] = max(2, out["hidden_size"] // shape["num_attention_heads"])
    return out


def random_draft_vocab(vocab: int, size: int) -> tuple[Any, Any]:
    """``size`` distinct ids of ``vocab`` drawn at random (seed 0) as EAGLE-3's ``d2t``/``t2d`` maps: a draft
    vocabulary for random-weight drafters, whose costs do not depend on which ids it holds."""
    ids = np.sort(np.random.default_rng(0).choice(vocab, size, replace=False))
    return eagle3_offset_maps(ids, vocab)


def llama3_8b_models(device: torch.device, dtype: torch.dtype = torch.bfloat16, scale: int = 1, *,
                     draft_vocab_size: int = LLAMA_DRAFT_VOCAB, dflash_layers: int = 5, block_size: int = 16,
                     clusters: int = 1024, routed_share: float = 0.22, methods: Sequence[str] = DECODE_BENCH,
                     ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The target and the proposers of :data:`~pipeline.engine.methods.DECODE_BENCH` (built through the registry) at
    the shapes of ``configs/llama3-8b.yaml``, random weights, built on ``device``: a same-tokenizer drafter
    (Llama-3.2-1B), its head routed over 1,024 log-normal clusters with a router and a fixed budget of the clusters
    holding ~22 % of the rows (DynaSpec's ~28k of 128k), an EAGLE-3 head over the 32k draft vocabulary, and a
    DFlash drafter (5 layers, B = 16); of those, the proposers of ``methods`` (a drafter no one of them reads is not
    built). ``scale`` > 1 divides every width (a smoke run of the same code on a CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # deferred: pulls in transformers

    def build(shape: dict) -> torch.nn.Module:
        with torch.device(device), heartbeat(f"building a random {shape.get('num_hidden_layers')}-layer model"):
            model = LlamaForCausalLM._from_config(LlamaConfig(**scaled_shape(shape, scale)), dtype=dtype)
        return model.eval()

    torch.manual_seed(0)
    target = build(LLAMA_3_1_8B)
    needed = {METHODS[method].inputs for method in methods}
    vocab = int(target.config.vocab_size)
    embedding = target.get_input_embeddings()
    inputs: dict[type, Any] = {}
    if needed & {SameTokenizerInputs, RoutedInputs}:
        drafter = build(LLAMA_3_2_1B)
        inputs[SameTokenizerInputs] = SameTokenizerInputs(drafter, target_vocab_size=vocab)
        if RoutedInputs in needed:
            head = drafter.get_output_embeddings().weight
            m = max(2, min(clusters, vocab // 4))
            with torch.device(device):  # initialised where it runs
                router = Router(2 * head.shape[1], max(8, 512 // scale), m).to(dtype=dtype).eval()
            clustering = Clustering.of_head(unbalanced_assignment(vocab, m), np.zeros((m, head.shape[1]), np.float32),
                                            head)
            budget = ClusterBudget("fixed", max(1, round(routed_share * m)))
            inputs[RoutedInputs] = RoutedInputs(drafter, clustering, router,
                                                ShortlistPolicy(keep_ids=(0,), fixed=budget), target_vocab_size=vocab)
    if FeatureInputs in needed:
        draft_vocab = max(2, draft_vocab_size // scale)
        config = Eagle3Config.from_target(target.config, draft_vocab_size=draft_vocab)
        with torch.device(device):  # initialised where it runs: ~1B float32 parameters are slow to fill on a CPU
            eagle3 = Eagle3Drafter(config, embedding).to(dtype=dtype).eval()
        eagle3.set_vocab_maps(*random_draft_vocab(vocab, draft_vocab))
        inputs[FeatureInputs] = FeatureInputs(eagle3, target_vocab_size=vocab)
    if BlockFeatureInputs in needed:
        dflash_config = DFlashConfig.from_target(target.config, num_hidden_layers=dflash_layers,
                                                 block_size=block_size, mask_token_id=vocab - 1)
        with torch.device(device):
            dflash = DFlashDrafter(dflash_config, embedding, target.get_output_embeddings()).to(dtype=dtype)
        inputs[BlockFeatureInputs] = BlockFeatureInputs(dflash.eval(), target_vocab_size=vocab)
    proposers = {method: build_proposer(method, inputs[METHODS[method].inputs]) for method in DECODE_BENCH
                 if method in methods}
    return target, proposers
