"""What several test modules share: the small configs of the test kit, synthetic evaluation results, a Hugging
Face cache entry and an artifact sealed by hand (no test module imports another).

``SMALL`` makes every stage quick on the ``test`` tiny kit; ``TRAIN`` and ``ROUTER`` add short training runs of the
EAGLE-3 head and the DynaSpec router.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeline.artifacts import SCHEMA_VERSION, artifact_id, seal_manifest, sha256_file
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.evaluation.results import EvalRow, EvaluationResults, LosslessCheck, decide_gates


def skip_unless(present: bool, missing: str, required_by: str, fix: str) -> None:
    """Skip the calling test when what it needs is missing (``missing`` says what), but fail instead where the
    environment variable ``required_by`` is ``1``: .ci/run sets it for what it installs, so a broken install there
    cannot pass as a skip."""
    if present:
        return
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{required_by}=1 but {missing}: {fix}")
    pytest.skip(f"{missing} ({fix})")


def requires_triton() -> Any:
    """A mark skipping a test of the routed head's Triton kernel where triton is not installed, unless
    ``DRAFTER_REQUIRE_TRITON=1`` (.ci/run): the kernel runs in Triton's interpreter on the CPU, so only a missing dev
    install skips it, and CI's install has it."""
    from pipeline.engine.routed_head import triton_available  # deferred: pulls in torch

    required = os.environ.get("DRAFTER_REQUIRE_TRITON") == "1"
    return pytest.mark.skipif(not (triton_available() or required),
                              reason="triton is not installed (the dev extra installs it)")


SMALL = ["target.model=tiny:test/target", "generate.limit=40", "generate.shard_size=4", "generate.batch_size=4",
         "generate.max_new_tokens=12", "generate.max_prompt_tokens=48", "generate.accelerator=cpu",
         "generate.devices=1", "count.top_k=[16,64]", "count.top_p=[0.9]", "count.min_count=[2]",
         "count.draft_vocab_size=64", "evaluate.shortlists=[top_k_16,top_k_64]", "evaluate.dynaspec_match=top_k_64",
         "evaluate.drafter=tiny:test/drafter", "cluster.drafter=tiny:test/drafter",
         "evaluate.drafter_other=tiny:test/drafter_other", "evaluate.drafter_bytes=tiny:test/drafter_bytes",
         "mlflow.experiment=stages", "mlflow.log_artifacts=false",
         # within the test kit's 128-token context (checked at plan time): 64 + 32 + gamma 4 + 1 and 128
         "evaluate.max_prompt_tokens=64", "evaluate.max_new_tokens=32", "train_drafter.max_length=128",
         "train_dflash.max_length=128"]


TRAIN = ["train_drafter.ttt_steps=3", "train_drafter.eval_fraction=0.2", "train_drafter.train.max_steps=24",
         "train_drafter.train.global_batch_size=8", "train_drafter.train.micro_batch_size=4",
         "train_drafter.train.eval_every=8", "train_drafter.train.checkpoint_every=4",
         "train_drafter.train.lr=3e-3", "train_drafter.train.warmup_steps=2",
         "train_drafter.train.progress_bar=false", "mlflow.experiment=train-drafter-tests"]

CLUSTERS = 16
ROUTER = ["cluster.drafter=tiny:test/drafter", f"cluster.clusters={CLUSTERS}", "train_router.eval_fraction=0.2",
          "train_router.hidden_size=64", "train_router.train.max_steps=24", "train_router.train.global_batch_size=8",
          "train_router.train.micro_batch_size=4", "train_router.train.eval_every=8",
          "train_router.train.checkpoint_every=4", "train_router.train.warmup_steps=2",
          "train_router.train.progress_bar=false", "mlflow.experiment=dynaspec-tests"]


def small_cfg(workdir: Path, *extra: str) -> PipelineConfig:
    return load_config(None, [f"workdir={workdir}", *SMALL, *extra])


TIMED_ROW_FIELDS = ("tokens_per_s", "speedup", "predicted_speedup", "ttft_ms", "tpot_ms", "drafter_ms_per_round",
                    "target_ms_per_round", "head_ms_per_step")
"""An evaluation row's wall-clock fields: what two decodings of the same cells may differ in."""


def small_kit_profile() -> Any:
    """The `test` kit profile with a twentieth of its data and steps, named `determinism`: the same code path
    (tokenizers, every model's training, the target's answers, the held-out measures, mixed precision) in ~10 s per
    build on a quiet machine instead of ~2.5 min. Register it in ``pipeline.tiny.PROFILES`` (a subprocess too) to build
    it. Its target answers with half the test kit's new tokens and it is measured on a fifth of the held-out chats:
    under a running test suite those two phases took 17 of its 37 s at the test kit's lengths."""
    import dataclasses

    from pipeline.tiny import PROFILES

    return dataclasses.replace(PROFILES["test"], name="determinism", train_conversations=75, eval_conversations=12,
                               target_steps=40, drafter_steps=25, other_steps=40, byte_steps=25, gen_prompts=8,
                               gen_new_tokens=32)


DEVICE_METHODS = ("full", "shortlist", "pa_fr", "dynaspec", "dynaspec_pa", "pruned", "rdk", "rdk_taylor", "rdk_prior",
                  "eagle3", "dflash", "dflash_draft_head")
"""Methods whose drafts stay on the device (the others read their text: string-level and cross-tokenizer): the ones
the static decode path runs; and DFlash with its own draft-vocabulary head (``tests/engine``'s ``proposers`` fixture's
``dflash_draft_head``)."""
STATIC_FAMILIES = ("full", "dynaspec", "eagle3", "dflash", "dflash_draft_head")
"""One device-drafting method per way of drafting on the static path, where the static-path law tests run: a drafter
session under the full head and under the routed head (a fixed-capacity shortlist chosen on the device), EAGLE-3's
chain, DFlash's block under the target's head and under its own. What the static path changes is where the caches live
(the target's session, the drafter session :class:`~pipeline.engine.proposers.SessionProposer` prepares for every
other device method, EAGLE-3's and DFlash's own buffers); the heads that turn a drafter row into ``q`` (shortlists,
PA budgets, RDK) are the eager path's code, whose law every method is tested under on the eager path
(``test_every_method.py``, ``test_position_law.py``), and every device method decodes greedily to the autoregressive
tokens on the static path (``test_static_decode.py``)."""


# --- evaluation results without decoding (the report and the gates) ---
GAMMA = 3
SHORTLISTS = [("top-k 512", 512), ("top-p 0.95", 2048), ("top-k 8192", 8192)]


def report_row(
    task: str,
    method: str,
    tau: float,
    alpha: float | None,
    drafter: str | None = "tiny-drafter",
    shortlist: tuple[str, int] | None = None,
    predicted: float | None = None,
) -> dict:
    ar = method == "ar"
    return {
        "task": task,
        "method": method,
        "drafter": None if ar else drafter,
        "gamma": GAMMA,
        "shortlist": shortlist[0] if shortlist else None,
        "shortlist_size": shortlist[1] if shortlist else None,
        "prompts": 16,
        "new_tokens": 1024,
        "target_forwards": round(1024 / tau),
        "tau": tau,
        "acceptance_rate": alpha,
        "per_position_acceptance": [] if ar else [alpha ** (i + 1) for i in range(GAMMA)],
        "tokens_per_s": 40.0 * tau * (1.0 if ar else 0.8),
        "speedup": 1.0 if ar else tau * 0.8,
        "predicted_speedup": predicted,
        "mbsu": None if ar else tau / 1.3,
        "ttft_ms": 12.0,
        "tpot_ms": 25.0 / tau,
        "drafter_ms_per_round": None if ar else 3.0,
        "target_ms_per_round": 25.0,
        "greedy_equal": None if ar else True,
    }


def synthetic_results() -> dict:
    """Two tasks; AR, full head, three shortlists, TLI, Union and SLEM at γ = 3 (8 rows per task)."""
    rows = []
    for task, scale in (("chat", 1.0), ("code", 1.15)):
        rows.append(report_row(task, "ar", 1.0, None))
        rows.append(report_row(task, "full", 2.4 * scale, 0.62, predicted=2.1 * scale))
        for i, shortlist in enumerate(SHORTLISTS):
            tau = (2.0 + 0.15 * i) * scale
            rows.append(
                report_row(task, "shortlist", tau, 0.5 + 0.04 * i, shortlist=shortlist, predicted=tau * 0.85)
            )
        rows.append(report_row(task, "tli", 1.9 * scale, 0.45, drafter="other-tokenizer", predicted=1.7))
        rows.append(report_row(task, "union", 1.7 * scale, 0.41, drafter="other-tokenizer", predicted=1.5))
        rows.append(report_row(task, "slem", 2.0 * scale, 0.48, drafter="other-tokenizer", predicted=1.8))
    return {
        "target": {"model": "tiny-target", "revision": "abc123", "vocab_hash": "deadbeef"},
        "device": "cpu (2 cores)",
        "created": "2025-01-01T00:00:00+00:00",
        "rows": rows,
        "lossless": {
            "passed": True,
            "checks": [{"name": "greedy equals AR", "passed": True, "detail": "22/22"}],
        },
        "gates": {
            "passed": True,
            "checks": {
                "tau_full_chat": {"passed": True, "value": 2.4, "threshold": 1.5, "detail": "τ ≥ 1.5"},
                "lossless": {"passed": True, "value": True, "threshold": True, "detail": "all methods"},
            },
        },
        "registration": None,
    }


def typed_results(data: dict | None = None, *, lossless: bool = True) -> EvaluationResults:
    data = data or synthetic_results()
    rows = [EvalRow(**r) for r in data["rows"]]
    checks = [LosslessCheck("greedy_equal[chat/full/γ=3]", lossless, "8/8 prompts")]
    gates = decide_gates(rows, checks, speed_metric="mbsu", tau_min=1.5, speed_min=1.0)
    return EvaluationResults(rows=rows, checks=checks, gates=gates, device="cpu (2 threads)",
                             target=data["target"], inputs={"counts": "count-0123"})


def drafted(proposal: Any) -> tuple[list[int], Any]:
    """A proposal's drafts as host ids and its q (proposers that draft on the device return a tensor of ids)."""
    return proposal.token_list(), proposal.q


def first_token_law(target: Any, proposer: Any, context: list[int], gamma: int, params: Any, draws: int = 300,
                    options: Any = None) -> tuple[float, int, int, int]:
    """``draws`` first rounds from ``context`` (``first_rounds``, seed 1): the chi-square of the first emitted tokens
    against the target's p under ``params`` (pooled tail, :func:`chi_square_first_token`), and how many rounds took
    each verification branch. Returns ``(p-value, bins, rounds that accepted a draft, rounds that rejected one)``; a
    round that drafted nothing counts as neither."""
    import numpy as np
    import torch

    from pipeline.engine.loop import first_rounds  # deferred: pulls in torch and the engine
    from pipeline.engine.sampling import standardise  # deferred: pulls in torch
    from pipeline.evaluation.evaluator import (
        chi_square_first_token,  # deferred: pulls in torch and the engine
    )

    with torch.no_grad():
        p = standardise(target(torch.tensor([context])).logits[0, -1], params).numpy()
    counts = np.zeros(p.size, dtype=np.int64)
    accepted = rejected = 0
    for step in first_rounds(target, proposer, context, gamma, params, torch.Generator().manual_seed(1), draws,
                             options=options):
        counts[step.emitted[0]] += 1
        accepted += step.accepted > 0
        rejected += step.accepted < step.drafted
    pvalue, bins = chi_square_first_token(counts, p)
    return pvalue, bins, accepted, rejected


def compiled_shapes() -> dict[Any, frozenset]:
    """Every live compiled function of path ``graphs`` (kept sessions' and drafters'
    :class:`~pipeline.engine.static.Compiled`) and the shapes it has compiled so far."""
    import gc

    from pipeline.engine.static import Compiled  # deferred: pulls in torch and the engine

    return {c: frozenset(c.shapes) for c in gc.get_objects() if type(c) is Compiled}  # not isinstance: dead proxies


def kit_evaluator(tmp_path: Path, path: str, *extra: str, staging: Path | None = None):  # noqa: ANN201
    """An :class:`~pipeline.evaluation.evaluator.Evaluator` over the test kit with full drafts at γ 2 and 3 (staging
    its finished pieces in ``staging``, where given)."""
    from jobs import run  # deferred: pulls in the stages and torch
    from pipeline.evaluation.evaluator import Evaluator  # deferred: pulls in torch and the engine
    from pipeline.models.target import Target  # deferred: pulls in transformers

    cfg = load_config(None, [f"workdir={tmp_path}", *SMALL, "evaluate.methods=[full]", "evaluate.gammas=[2,3]",
                             f"evaluate.decode_path={path}", "evaluate.sampling_check_samples=0",
                             "evaluate.law_check_generations=0", *extra])
    counts = run(cfg, ["count"])["count"]  # full drafts over the kit's drafter; the count artifact is read regardless
    target = Target(cfg.target)
    return lambda prompts: Evaluator(cfg, target.model("cpu"), target.tokenizer(), prompts, {"count": counts}, "cpu",
                                     lambda _line: None, staging)


def offline_hub(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face cache at ``cache``, offline. huggingface_hub reads HF_HUB_OFFLINE when it is imported: the
    variable alone left the loaders asking the unreachable hub first (about 4 minutes of timeouts a test)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def hub_cache(root: Path, name: str, commits: dict[str, Path], *, blobs: bool = False) -> None:
    """A Hugging Face cache entry as a download leaves it: refs/main -> commit, snapshots/<commit>/ files; with
    ``blobs``, each file in ``blobs/`` under its sha256 (safetensors, as Git LFS names them) or its git object id (the
    rest) and the snapshot's entry a relative link to it."""
    repo = root / f"models--{name.replace('/', '--')}"
    for commit, files in commits.items():
        shutil.copytree(files, repo / "snapshots" / commit)
        if not blobs:
            continue
        (repo / "blobs").mkdir(exist_ok=True)
        for file in sorted(p for p in (repo / "snapshots" / commit).rglob("*") if p.is_file()):
            data = file.read_bytes()
            lfs = file.suffix == ".safetensors"
            blob = (hashlib.sha256(data) if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data)).hexdigest()
            (repo / "blobs" / blob).write_bytes(data)
            file.unlink()
            file.symlink_to(Path(*[".."] * (len(file.relative_to(repo).parts) - 1), "blobs", blob))
    (repo / "refs").mkdir(parents=True)


def hand_sealed(directory: Path, stage: str, inputs: list[str], fingerprint: dict, payload: bool = True) -> str:
    """An artifact written by hand at ``directory / <its id>`` (wherever a stage name such as ``../x`` puts it), with
    one payload or none, its checksums and id recomputed as whoever can write a store can; returns its id."""
    aid = artifact_id(stage, {}, inputs, fingerprint)
    (directory / aid).mkdir(parents=True)
    files = {}
    if payload:
        (directory / aid / "a.json").write_text("{}")
        files = {"a.json": {"sha256": sha256_file(directory / aid / "a.json"), "bytes": 2}}
    (directory / aid / "manifest.json").write_text(json.dumps(seal_manifest({
        "id": aid, "schema_version": SCHEMA_VERSION, "kind": "calibration", "stage": stage, "config": {},
        "inputs": inputs, "fingerprint": fingerprint, "files": files, "metrics": {}})))
    return aid
