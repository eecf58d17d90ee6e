"""String-level rejection sampling (SLRS; Timor et al., ICML 2025, §3.3-3.4, Alg. 3) with a byte drafter.

SLRS drafts a *string* with the drafter, tokenises it with the target tokenizer, proposes the first
target token ``t1`` and verifies it by rejection sampling against ``psi(t1)``, the probability that the
drafting procedure yields ``t1`` as its first target token (Thm. 3.2). Computing ``psi`` means summing
over every drafter sequence whose string starts with ``t1``, which blows up with the drafter's token
lengths (§3.4, Lemma 3.3); a drafter whose vocabulary is the 256 single bytes keeps it finite and small.
:class:`SLRSProposer` owns that computation: its drafting law draws ``lookahead`` bytes from the
drafter's standardised distribution truncated to its ``byte_top_k`` most likely entries, so the
strings form a trie with at most ``byte_top_k ** lookahead`` leaves, which it enumerates exactly, one
batched drafter forward per depth. ``q = psi`` is then verified by the standard
:func:`~pipeline.engine.verify.verify_speculative`, which *is* Alg. 3 lines 6-8 (accept with
``min(1, p/psi)``, else sample ``norm(max(0, p - psi))``). :class:`ByteBudgetSLEMProposer` is SLEM
(Alg. 2) on the same byte drafter with the same string budget, the baseline the evaluation compares
acceptance and drafter calls per target token against (methods ``slrs`` and ``slem_bytes``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

import torch
from torch import Generator, Tensor

from pipeline.engine.bridge import CrossVocabDrafter, empty_proposal
from pipeline.engine.proposers import Proposal
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import TargetState, cache_argument, returned_cache
from pipeline.engine.slem import SLEMProposer, align_drafts, byte_lengths
from pipeline.errors import DrafterError
from pipeline.vocab.tokens import token_meanings

MAX_LEAVES = 1 << 16
"""Largest trie (``byte_top_k ** lookahead`` leaves) a proposer accepts."""
_MIXED = -2  # a subtree whose leaves disagree on t1 (t1 not yet determined)
PRUNE_MODES = ("calls", "rows", "off")
"""SLRS's lookahead pruning: skip a depth's call when all its nodes are proven, skip every proven row, or never."""
_MEMO_WINDOWS = 16  # alignment windows whose looked-up texts are kept across rounds (a few MB each at most)
_PROBES = " e\nast.,'01"
"""Next characters most likely to change a first token (extend a word, number or contraction)."""
_ASCII_ORDER = _PROBES + "".join(chr(c) for c in range(128) if chr(c) not in _PROBES)


def valid_text(prefix: bytes) -> str:
    """The longest prefix of ``prefix`` that is valid UTF-8, as text (a split character is dropped)."""
    try:
        return prefix.decode("utf-8")
    except UnicodeDecodeError as err:
        return prefix[: err.start].decode("utf-8")


def _continuations(prefix: bytes) -> tuple[str, list[str]]:
    """The text of ``prefix``, and every other text one more byte can make (:data:`_PROBES` first)."""
    own = valid_text(prefix)
    if len(own.encode("utf-8")) == len(prefix):
        # Complete text: an ASCII byte appends a character; any other byte starts (or breaks) a
        # multi-byte character and adds no text.
        return own, [own + char for char in _ASCII_ORDER]
    return own, sorted({valid_text(prefix + bytes([byte])) for byte in range(256)} - {own})


@dataclass
class SLRSStats:
    """What SLRS cost, summed over proposals until :meth:`reset`.

    Attributes:
        proposed: Target tokens proposed (a draft with no target token, ``-1``, included).
        path_forwards: Bytes sampled before ``t1`` was determined: the drafter forwards a sequential
            SLRS with §3.3's stopping rule runs (one per sampled byte, the first over the context)
            when told, as by this trie, whether a prefix is determined. An idealisation: it is 0
            when the root is determined, e.g. always under greedy decoding (one string).
        trie_nodes: Next-byte distributions computed to get ``psi`` exactly (each trie's root included):
            drafter rows, the paper's "non-leaf nodes plus one" (Appendix D).
        trie_calls: Drafter calls made for them (one per trie depth, batched over its nodes).
        pruned: Nodes at depth ``lookahead - 1`` proven to determine ``t1`` whatever byte follows, whose
            forward was skipped.
        leaves: Strings whose first target token was looked up.
    """

    proposed: int = 0
    path_forwards: int = 0
    trie_nodes: int = 0
    trie_calls: int = 0
    pruned: int = 0
    leaves: int = 0

    def reset(self) -> None:
        for name in asdict(self):
            setattr(self, name, 0)


@dataclass
class _Node:
    """One drafted string: its bytes, its probability under the drafting law, and the subtree below it."""

    prefix: bytes
    prob: float
    token: int = -1
    """Drafter id drawn last (the byte's token, or the special that ended the string)."""
    ended: bool = False
    children: list[int] = field(default_factory=list)
    child_probs: list[float] = field(default_factory=list)
    """The drafting law over ``children`` (renormalised top-k), exactly as sampled from."""
    first: int | None = None
    """t1 once known: -1 for none, :data:`_MIXED` where leaves below disagree."""


def _select_rows(cache: Any, index: Tensor) -> Any:
    """A new ``DynamicCache`` holding rows ``index`` of ``cache`` (which is left untouched)."""
    from transformers import DynamicCache

    if hasattr(cache, "layers"):  # transformers 5
        # Built from empty rows, then handed the selected ones: a cache built from them would append them to its
        # empty tensors, copying every row a second time (half of this function's time).
        pairs = [(layer.keys, layer.values) for layer in cache.layers]
        selected = DynamicCache([(k[:0, ..., :0, :], v[:0, ..., :0, :]) for k, v in pairs])
        for layer, (k, v) in zip(selected.layers, pairs, strict=True):
            layer.keys, layer.values = k.index_select(0, index), v.index_select(0, index)
        return selected
    pairs = list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers 4
    return DynamicCache.from_legacy_cache(tuple((k.index_select(0, index), v.index_select(0, index))
                                                for k, v in pairs))  # fmt: skip


class SLRSProposer(CrossVocabDrafter):
    """String-level rejection sampling (Alg. 3) with a byte-level drafter.

    Drafting law (Alg. 3 line 4): from the drafter's standardised next-token distribution (``params``:
    temperature, top-k, top-p), keep its ``byte_top_k`` most likely entries, renormalise, draw one; draw
    ``lookahead`` bytes this way, unless a non-byte token (EOS, a chat marker) ends the string first. Line 5:
    the string's longest valid UTF-8 prefix is appended to the context's text and re-tokenised by the
    target (:func:`~pipeline.engine.slem.align_drafts`, look-behind re-alignment); ``t1`` is the first
    target token after the context, a string ended at once by a drafter special is that special's
    target twin (the drafter's EOS proposes the target's), and ``-1`` ("none") is a string with no
    target token boundary at the context's end or no text.

    ``psi(t) = P(t1 = t)`` under this law (Thm. 3.2) is computed exactly by enumerating the trie of
    drafted strings: one batched drafter forward per depth over every live prefix, each row continuing
    the context's KV cache (§3.4 counts these rows). §3.3's lookahead rule ``S_1``: a prefix all of
    whose reachable leaves give the same ``t1`` determines it; the sampled path (one uniform per byte,
    :func:`~pipeline.engine.sampling.sample`) stops there, so ``t1`` is drawn exactly from ``psi``, and
    the bytes it sampled are the drafter forwards a sequential SLRS needs (:class:`SLRSStats`). With
    ``prune``, a node at depth ``lookahead - 1`` is first checked against all 256 possible next bytes and
    the string ending; if every one gives the same ``t1``, it is determined whatever the drafter says and
    its forward can be skipped (by default only when that skips the depth's whole call). ``q = psi`` (one
    row per token, float64, in target-id space; sub-stochastic by ``P(none)``) goes to the standard
    verifier, whose accept test ``min(1, p/psi)`` and residual ``max(0, p - psi)`` are Alg. 3 lines 6-8,
    so the output keeps the target's law (Thm. 3.2).

    ``gamma > 1``: after ``t1`` a fresh trie is drafted from context + ``t1`` (its text fed to the
    drafter), giving ``t2`` with its own exact ``psi_2``, and so on. The bytes the first string drew past
    ``t1`` are discarded: conditioned on ``T(s)_1 = t1`` their law is no longer the drafter's, so they
    could not be given a ``q`` (§3.3, "Block verification is non-trivial"). Each row being the exact
    law of its token given the tokens before it is all multi-token verification needs. Drafting stops
    after a ``-1`` or a target special token.

    Greedy decoding (``params.greedy``): ``byte_top_k`` acts as 1 (the argmax byte path) and ``q`` is
    one-hot at ``t1``.

    Args:
        drafter: A Hugging Face causal LM whose tokenizer is byte-level.
        drafter_tokenizer: Its tokenizer: every single byte is a token, and no text token is longer.
        target_tokenizer: The target's tokenizer.
        byte_top_k: Bytes kept per draw (the trie's branching factor).
        lookahead: Bytes drawn per string (the trie's depth).
        target_lookbehind: Context tokens re-encoded with the draft.
        prune: Which depth ``lookahead - 1`` nodes to prove determined (:data:`PRUNE_MODES`). ``"calls"``
            (default): only when every node there may be proven, so the depth's whole drafter call is skipped
            (greedy decoding: one node, one call in ``lookahead`` saved); the proof stops at the first node
            that fails. ``"rows"``: every node, skipping the rows of the proven ones from a call that runs
            anyway: each proof costs 257 target-tokenizer lookups, so on the kit at temperature 1 it halved
            the rows at about 5x the wall time. ``"off"``: none.
        keep_specials: Hand shared special tokens to the drafter (see :class:`~pipeline.engine.bridge.CrossVocabDrafter`).
        target_vocab_size: Width of ``q``; defaults to the target tokenizer's id span.
        name: Label used in metrics and reports.

    Raises:
        DrafterError: ``byte_top_k`` or ``lookahead`` below 1, a trie over :data:`MAX_LEAVES` leaves, or
            a drafter tokenizer that is not byte-level.
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        drafter_tokenizer: Any,
        target_tokenizer: Any,
        *,
        byte_top_k: int = 4,
        lookahead: int = 4,
        target_lookbehind: int = 8,
        prune: str = "calls",
        keep_specials: bool = True,
        target_vocab_size: int | None = None,
        name: str = "slrs",
    ) -> None:
        for label, value in (("byte_top_k", byte_top_k), ("lookahead", lookahead)):
            if value < 1:
                raise DrafterError(
                    f"SLRS needs {label} >= 1",
                    expected=f"{label} >= 1 (4 is a good start)",
                    found=f"{label}={value}",
                    fix=f"set {label} to a positive integer",
                )
        if prune not in PRUNE_MODES:
            raise DrafterError(
                "unknown SLRS prune mode",
                expected=f"one of {', '.join(PRUNE_MODES)}",
                found=f"prune={prune!r}",
                fix='use "calls" (skip a depth\'s call when every node is proven), "rows" or "off"',
            )
        if byte_top_k**lookahead > MAX_LEAVES:
            raise DrafterError(
                "the SLRS string trie is too large to enumerate",
                expected=f"byte_top_k ** lookahead <= {MAX_LEAVES}",
                found=f"{byte_top_k} ** {lookahead} = {byte_top_k**lookahead}",
                fix="lower byte_top_k or lookahead (e.g. 4 and 4)",
            )
        super().__init__(drafter, drafter_tokenizer, target_tokenizer, keep_specials=keep_specials)
        self.byte_top_k, self.lookahead = byte_top_k, lookahead
        self.target_lookbehind = max(1, target_lookbehind)
        self.prune = prune
        self.name = name
        self._byte_of = _byte_table(self.drafter_tokenizer)
        target_specials = {
            token.content: token_id
            for token_id, token in self.target_tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        self.target_specials = set(target_specials.values())
        self._special_target = {
            token_id: target_specials.get(token.content, -1)
            for token_id, token in self.drafter_tokenizer.get_added_tokens_decoder().items()
        }
        self.target_vocab_size = target_vocab_size or self.target_tokenizer.get_vocab_size(True)
        self._target_bytes = byte_lengths(self.target_tokenizer)
        self._memos: OrderedDict[tuple[int, ...], dict[str, int]] = OrderedDict()
        self.stats = SLRSStats()

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft up to ``gamma`` target tokens, each with its exact ``psi``; see the class docstring."""
        started = self._start(context, gamma)
        if started is None:
            return empty_proposal(self.target_vocab_size, torch.device("cpu"))
        logits = started[1]
        tokens: list[int] = []
        rows: list[Tensor] = []
        for step in range(gamma):
            token, psi = self._draft_token(list(context) + tokens, logits, params, generator)
            tokens.append(token)
            rows.append(psi)
            if token < 0 or token in self.target_specials or step + 1 == gamma:
                break
            logits = self.session.move_to(self.drafter_ids(list(context) + tokens))[-1]
        return Proposal(tokens, torch.stack(rows))

    def _draft_token(
        self, context: list[int], root_logits: Tensor, params: SamplingParams, generator: Generator
    ) -> tuple[int, Tensor]:
        """One SLRS draft after ``context`` (whose drafter logits are ``root_logits``): ``t1`` and ``psi``.

        ``psi`` sums the mass of each maximal determined subtree; the walk draws bytes from the same
        ``child_probs`` until it enters one, so ``P(t1 = t) = psi(t)``.
        """
        memo = self._memo(context)
        nodes = self._trie(context, root_logits, params, memo)
        self._resolve(nodes, context, memo)
        psi = torch.zeros(self.target_vocab_size, dtype=torch.float64)
        stack = [0]
        while stack:
            node = nodes[stack.pop()]
            if node.first == _MIXED:
                stack.extend(node.children)
            elif node.first is not None and 0 <= node.first < self.target_vocab_size:
                psi[node.first] += node.prob
        node = nodes[0]
        while node.first == _MIXED:
            law = torch.tensor(node.child_probs, dtype=torch.float64)
            node = nodes[node.children[int(sample(law, generator))]]
            self.stats.path_forwards += 1
        self.stats.proposed += 1
        return (node.first if node.first is not None and node.first < self.target_vocab_size else -1), psi

    @torch.no_grad()
    def _trie(
        self, context: list[int], root_logits: Tensor, params: SamplingParams, memo: dict[str, int]
    ) -> list[_Node]:
        """Expand the drafting law's trie depth by depth; children are appended after their parents."""
        k = 1 if params.greedy else min(self.byte_top_k, root_logits.shape[-1])
        byte_of = self._byte_table_for(root_logits.shape[-1])
        nodes = [_Node(b"", 1.0)]
        frontier, logits, cache = [0], root_logits.unsqueeze(0), self.session.cache
        self.stats.trie_nodes += 1
        self.stats.trie_calls += 1
        for depth in range(self.lookahead):
            top = torch.topk(standardise(logits, params), k, dim=-1)
            probs = (top.values / top.values.sum(dim=-1, keepdim=True)).tolist()
            grow: list[tuple[int, int]] = []  # (node, row of its parent in `cache`)
            for row, (index, tokens) in enumerate(zip(frontier, top.indices.tolist(), strict=True)):
                parent = nodes[index]
                for token, prob in zip(tokens, probs[row], strict=True):
                    if prob <= 0:
                        continue  # a top-k entry with no mass is not a child
                    byte = byte_of[token]
                    child = _Node(parent.prefix + bytes([byte]) if byte >= 0 else parent.prefix,
                                  parent.prob * prob, token, ended=byte < 0)  # fmt: skip
                    parent.children.append(len(nodes))
                    parent.child_probs.append(prob)
                    nodes.append(child)
                    if byte >= 0 and depth + 1 < self.lookahead:
                        grow.append((len(nodes) - 1, row))
            if self.prune != "off" and depth + 2 == self.lookahead and grow:
                grow = self._prune(nodes, grow, context, memo)
            if not grow:
                break
            cache = _select_rows(cache, torch.tensor([row for _, row in grow], device=self.session.device))
            fed = torch.tensor([[nodes[index].token] for index, _ in grow], device=self.session.device)
            out = self.session.model(input_ids=fed, use_cache=True, **{cache_argument(self.session.model): cache})
            frontier, logits, cache = [index for index, _ in grow], out.logits[:, -1], returned_cache(out)
            self.stats.trie_nodes += len(grow)
            self.stats.trie_calls += 1
        return nodes

    def _prune(
        self, nodes: list[_Node], grow: list[tuple[int, int]], context: list[int], memo: dict[str, int]
    ) -> list[tuple[int, int]]:
        """Mark the nodes of ``grow`` whose every one-byte continuation (and the string ending) gives one ``t1``,
        and return the rest.

        Exhaustive over the 256 possible next bytes, so it holds whatever the drafter's next-byte
        distribution is: such a node's forward cannot change ``t1``. The likeliest spoilers
        (:data:`_PROBES`) are tried first, so most nodes that are not determined cost a few lookups.
        ``"rows"`` checks every node, each phase in one batch. ``"calls"`` wants all of them: it probes node
        by node, then proves node by node, and gives up (marking nothing) at the first that fails.
        """
        whole = self.prune == "calls"
        options = cache(lambda index: _continuations(nodes[index].prefix))  # "calls" mostly stops at the first nodes
        survivors = grow
        for probes in (True, False):
            passed: list[tuple[tuple[int, int], int]] = []
            for batch in ([entry] for entry in survivors) if whole else [survivors]:
                agreed = self._agreeing(options, batch, context, memo, probes)
                if whole and not agreed:
                    return grow
                passed += agreed
            survivors = [entry for entry, _ in passed]
        for (index, _), first in passed:
            nodes[index].first = first
        self.stats.pruned += len(passed)
        proven = set(survivors)
        return [entry for entry in grow if entry not in proven]

    def _agreeing(
        self,
        options: Callable[[int], tuple[str, list[str]]],
        grow: list[tuple[int, int]],
        context: list[int],
        memo: dict[str, int],
        probes: bool,
    ) -> list[tuple[tuple[int, int], int]]:
        """The entries whose string and one-byte continuations (``options``, by node: :func:`_continuations`;
        :data:`_PROBES` if ``probes``, else the others) all give one ``t1``, with it; their lookups in one batch."""
        count = len(_PROBES)
        texts = []
        for index, _ in grow:
            own, rest = options(index)
            texts.append([own, *(rest[:count] if probes else rest[count:])])
        firsts = self._first_tokens(context, [text for group in texts for text in group], memo)
        agreed, at = [], 0
        for entry, group in zip(grow, texts, strict=True):
            found = set(firsts[at : at + len(group)])
            if len(found) == 1:
                agreed.append((entry, found.pop()))
            at += len(group)
        return agreed

    def _resolve(self, nodes: list[_Node], context: list[int], memo: dict[str, int]) -> None:
        """Give every leaf its ``t1``, then every inner node the common ``t1`` below it (or mixed)."""
        leaves = [i for i, node in enumerate(nodes) if not node.children and node.first is None]
        firsts = self._first_tokens(context, [valid_text(nodes[i].prefix) for i in leaves], memo)
        self.stats.leaves += len(leaves)
        for index, first in zip(leaves, firsts, strict=True):
            node = nodes[index]
            # A string ended before any byte: the drafter's special itself (EOS proposes the target's EOS).
            node.first = self._special_target.get(node.token, -1) if node.ended and not node.prefix else first
        for node in reversed(nodes):
            if node.children:
                below = {nodes[c].first for c in node.children}
                node.first = below.pop() if len(below) == 1 else _MIXED

    def _memo(self, context: list[int]) -> dict[str, int]:
        """The ``t1`` already looked up after this context's alignment window (a fresh dict for a new one).

        :func:`~pipeline.engine.slem.align_drafts` reads only the last ``target_lookbehind`` ids, so a text's
        ``t1`` is a function of that window and the text: rounds that start from the same window (evaluate's
        repeated first rounds, a decode revisiting a phrase) reuse the lookups. The most recent
        :data:`_MEMO_WINDOWS` windows are kept.
        """
        window = tuple(context[-self.target_lookbehind :])
        memo = self._memos.pop(window, None)
        self._memos[window] = memo = {} if memo is None else memo
        while len(self._memos) > _MEMO_WINDOWS:
            self._memos.popitem(last=False)
        return memo

    def _first_tokens(self, context: list[int], texts: list[str], memo: dict[str, int]) -> list[int]:
        """``t1`` of each drafted text after ``context`` (-1: empty text, or no boundary at the context end).

        ``memo`` holds the texts already looked up after this context; new ones are encoded in one batch.
        """
        new = [text for text in dict.fromkeys(texts) if text not in memo]
        if new:
            aligned = align_drafts(self.target_tokenizer, context, new, self.target_lookbehind, self._target_bytes)
            for text, ids in zip(new, aligned, strict=True):
                memo[text] = ids[0] if text and ids else -1
        return [memo[text] for text in texts]

    @property
    def drafter_calls(self) -> int:
        """Drafter calls so far: one per trie depth (batched over its nodes), each trie's root included."""
        return self.stats.trie_calls

    @property
    def drafter_rows(self) -> int:
        """Next-byte distributions computed so far for ``psi`` (:attr:`SLRSStats.trie_nodes`)."""
        return self.stats.trie_nodes

    def _byte_table_for(self, width: int) -> list[int]:
        """Byte of each drafter id up to the logits' width (-1: not a byte; padded head rows included)."""
        return self._byte_of + [-1] * max(0, width - len(self._byte_of))


def _byte_table(tokenizer: Any) -> list[int]:
    """Drafter id -> the one byte it means (-1 for specials), refusing a vocabulary that is not byte-level."""
    meanings = token_meanings(tokenizer)
    text = {token_id: m.data for token_id, m in meanings.items() if m.kind == "text"}
    longer = sorted(token_id for token_id, data in text.items() if len(data) != 1)
    covered = {data[0] for data in text.values() if len(data) == 1}
    if longer or len(covered) < 256:
        raise DrafterError(
            "SLRS needs a byte-level drafter",
            expected="a drafter tokenizer whose text tokens are exactly the 256 single bytes",
            found=f"{len(longer)} multi-byte text tokens (e.g. ids {longer[:3]}), {256 - len(covered)} bytes "
            "without a token",
            fix="use a byte-level drafter such as tiny:<profile>/drafter_bytes "
            "(pipeline.tiny.text_tokenizers.byte_tokenizer), or SLEM / TLI for a subword drafter",
        )
    table = [-1] * (max(meanings, default=-1) + 1)
    for token_id, data in text.items():
        table[token_id] = data[0]
    return table


class ByteBudgetSLEMProposer(SLEMProposer):
    """SLEM drafting ``bytes_per_token`` drafter tokens per target token asked for (capped at ``gamma``).

    SLEM's ``gamma`` counts drafter tokens; with a byte drafter ``gamma`` bytes rarely make ``gamma``
    target tokens, so method ``slem_bytes`` gives it the same string budget per target token as SLRS's
    ``lookahead``. Exact-match verification keeps it lossless whatever it drafts (``q`` is ``None``).

    Args:
        *args: :class:`~pipeline.engine.slem.SLEMProposer`'s drafter, drafter tokenizer, target tokenizer.
        bytes_per_token: Drafter tokens (bytes) drafted per target token asked for.
        name: Label used in metrics and reports.
        **kwargs: Further :class:`~pipeline.engine.slem.SLEMProposer` options (``keep_specials``, ...).
    """

    def __init__(self, *args: Any, bytes_per_token: int, name: str = "slem_bytes", **kwargs: Any) -> None:
        super().__init__(*args, name=name, **kwargs)
        if bytes_per_token < 1:
            raise DrafterError("SLEM's byte budget must be positive", expected="bytes_per_token >= 1",
                               found=f"bytes_per_token={bytes_per_token}", fix="use SLRS's lookahead (e.g. 4)")
        self.bytes_per_token = bytes_per_token

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        proposal = super().propose(context, gamma * self.bytes_per_token, params, generator, state)
        return Proposal(proposal.tokens[:gamma], None)
