"""The evaluate stage end to end on the tiny kit's test profile, against a real MLflow server: every
method is lossless on real trained models, the report is written, a passing bundle is registered with
aliases, `drafter pull` verifies it and refuses tampering; bad input gives clear errors."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from mlflow.tracking import MlflowClient

from jobs import cli as cli_module
from jobs import evaluate, run
from jobs.cli import main as cli
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.errors import DrafterError
from pipeline.evaluation import evaluator as evaluator_module
from pipeline.progress import Progress
from tests.helpers import ROUTER, SMALL, TRAIN
from tests.mlflow_server import MlflowServer, serve

EVAL = ["evaluate.drafter=tiny:test/drafter", "evaluate.drafter_other=tiny:test/drafter_other",
        "evaluate.shortlists=[top_k_16,top_k_64]", "evaluate.prompts_per_task=3", "evaluate.max_new_tokens=24",
        "evaluate.max_prompt_tokens=64", "evaluate.gammas=[1,4]",
        # float64 makes batched verification and one-token decoding round identically, so greedy outputs must
        # agree bit for bit (no tie tolerance); the first-token check draws 200 first rounds per configuration (12),
        # p-value >= 1e-4, and the every-position check decodes 4 generations of each: how the stage checks, at sizes
        # that keep the test's time; each method's law is tested at every position over 40 generations and at
        # n = 200,000 draws in tests/engine, and these checks' power by the lossy proposers below.
        "target.dtype=float64", "evaluate.tie_tolerance=0", "evaluate.sampling_check_samples=200",
        "evaluate.law_check_generations=4",
        "evaluate.gate_tau_min=1.05", "evaluate.gate_speed_min=0.5", *TRAIN, *ROUTER, "evaluate.dynaspec_match=top_k_64",
        "train_drafter.ttt_steps=4",  # EAGLE-3 is evaluated at gamma <= its trained steps (checked at plan time)
        "evaluate.methods=[full,shortlist,pa_fr,dynaspec,dynaspec_pa,eagle3,tli,union,slem,slrs,slem_bytes]",
        "evaluate.slrs_byte_top_k=3", "evaluate.slrs_lookahead=3",
        "mlflow.experiment=evaluate-tests"]  # the RDK methods are evaluated in tests/test_rdk_stage.py


def eval_cfg(workdir: Path, uri: str, *extra: str) -> PipelineConfig:
    return load_config(None, [f"workdir={workdir}", *SMALL, *EVAL, f"mlflow.tracking_uri={uri}", *extra])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """This module's own server: its checks read which version holds `champion` of bundle names (…-eagle3,
    …-dynaspec) that other files register on the worker's shared server too, in whatever order xdist runs them."""
    yield from serve(tmp_path_factory)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory, tiny_kit, mlflow_server: MlflowServer):
    workdir = tmp_path_factory.mktemp("evaluate")
    cfg = eval_cfg(workdir, mlflow_server.uri)
    artifact = run(cfg, ["evaluate"])["evaluate"]  # builds generate and count first
    return cfg, artifact, json.loads(artifact.file("report.json").read_text())


def test_every_method_is_lossless_on_the_tiny_kit(evaluated) -> None:
    _, _, results = evaluated
    methods = {(r["task"], r["method"]) for r in results["rows"]}
    assert methods == {(t, m) for t in ("chat", "code")
                       for m in ("ar", "full", "shortlist", "pa_fr", "dynaspec", "dynaspec_pa", "eagle3", "tli",
                                 "union", "slem", "slrs", "slem_bytes")}
    for row in results["rows"]:
        assert row["greedy_equal"] is True, row  # token for token, every prompt, every γ
    names = [c["name"] for c in results["lossless"]["checks"]]
    # full, 2 shortlists, pa_fr, dynaspec, dynaspec_pa, eagle3, tli, union, slem, slrs, slem_bytes
    assert sum(n.startswith("first_token_distribution") for n in names) == 12
    for check in results["lossless"]["checks"]:
        if check["name"].startswith("first_token_distribution"):
            verified = int(check["detail"].split("first-round drafts verified: ")[1].split()[0])
            assert verified > 0, check  # the check exercised verification, not just sampling from p
    failed = [c for c in results["lossless"]["checks"] if not c["passed"]]
    assert not failed and results["lossless"]["passed"]


def test_report_prints_the_evaluation_its_config_plans(evaluated, tmp_path: Path, capsys) -> None:
    """`drafter report --config C` printed the newest evaluation in the workdir, whatever C planned: after C's own
    evaluation failed, CI's summary showed another config's table and its gates. It prints C's, and refuses (naming
    the newest other one) when C's is not built."""
    cfg, artifact, _ = evaluated
    (tmp_path / "built-in.yaml").write_text("{}\n")  # the built-in defaults, as eval_cfg (not configs/tiny.yaml)
    common = ["--config", str(tmp_path / "built-in.yaml"), f"workdir={cfg.workdir_path}", *SMALL, *EVAL,
              f"mlflow.tracking_uri={cfg.mlflow.tracking_uri}"]
    assert cli(["report", *common]) == 0
    assert f"full report: {artifact.file('report.html')}" in capsys.readouterr().out
    newer = cfg.workdir_path / "artifacts" / "evaluate-0000000000000000"  # another evaluation, written later
    shutil.copytree(artifact.path, newer)
    later = (newer / "manifest.json").stat().st_mtime + 60
    os.utime(newer / "manifest.json", (later, later))
    try:
        assert cli(["report", *common, "evaluate.max_new_tokens=8"]) == 2
        err = capsys.readouterr().err
        assert "this config plans" in err and "is not built" in err and newer.name in err
        assert cli(["report", *common]) == 0  # still its own, not the newer one
        assert f"full report: {artifact.file('report.html')}" in capsys.readouterr().out
    finally:
        shutil.rmtree(newer)


class EveryUpdate(Progress):
    """A real :class:`Progress` that writes a line at every update (no grace, no interval) into ``LINES``."""

    LINES: ClassVar[dict[str, list[tuple[int, int | None]]]] = {}

    def __init__(self, what: str, total: int | None, unit: str = "step", **_: object) -> None:
        super().__init__(what, total, unit, log=lambda line: None, interval=0.0, grace=0.0, bar=False)
        self.LINES[what] = []

    def update(self, n: int = 1, **info: object) -> None:
        super().update(n, **info)
        if n:
            self.LINES[self.what].append((self.done, self.total))


def test_a_sampled_evaluation_checks_the_law_it_decodes_with(tmp_path: Path, tiny_kit,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """At evaluate.temperature=0.7 and top_p=0.9 the rows' τ is measured under that law, and the first-token check
    now tests that law (it tested temperature 1 without a nucleus, so a fault in nucleus-sampled verification would
    have inflated the gated τ without failing anything). 200 draws a method, p-value >= 1e-4.

    The decoding phase counts each generation, not each cell (a cell of all a task's prompts took 41 s on a slow
    machine, past the 30 s a log may stay silent): here 2 prompts × (autoregressive + 2 configurations) × (greedy +
    sampled) = 12 generations, one line each."""
    monkeypatch.setattr(evaluator_module, "Progress", EveryUpdate)
    cfg = load_config(None, [f"workdir={tmp_path}", *SMALL, "evaluate.methods=[full,shortlist]",
                             "evaluate.shortlists=[top_k_64]", "evaluate.prompts_per_task=2", "evaluate.tasks=[chat]",
                             "evaluate.max_new_tokens=8", "evaluate.gammas=[2]", "evaluate.sampling_check_samples=200",
                             "evaluate.temperature=0.7", "evaluate.top_p=0.9", "evaluate.register=false"])
    results = json.loads(run(cfg, ["evaluate"])["evaluate"].file("report.json").read_text())
    checks = [c for c in results["lossless"]["checks"] if c["name"].startswith("first_token_distribution")]
    assert len(checks) == 2 and all(c["passed"] for c in checks), checks
    assert all("temperature 0.7, top-p 0.9" in c["detail"] for c in checks), checks
    assert EveryUpdate.LINES["evaluate: decoding"] == [(done, 12) for done in range(1, 13)]


def test_a_greedy_divergence_is_a_tie_only_near_the_top_logit(tmp_path: Path, tiny_kit) -> None:
    """A greedy mismatch passes the losslessness check as a floating-point tie when the two logits differ by at most
    tie_tolerance relative to the largest logit. The bound was scaled by the largest *absolute* logit: a target that
    masks a padded vocabulary row (-inf) made every divergence a tie, even to the least likely token. Here that
    divergence is no tie, with the masked row or without it."""
    import torch

    from tests.helpers import kit_evaluator

    prompt = [5, 6, 7]
    evaluator = kit_evaluator(tmp_path, "eager", "evaluate.max_new_tokens=6", "evaluate.tie_tolerance=1e-4")(
        {"chat": [prompt]})
    with torch.no_grad():
        logits = evaluator.target(torch.tensor([prompt])).logits[0, -1]
    top, far = int(logits.argmax()), int(logits[:-1].argmin())
    assert not evaluator._is_tie(prompt, [top], [far])

    class MaskedPadding(torch.nn.Module):
        """The same target with its last vocabulary row masked, as a target with a padded head masks it."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: object, **kwargs: object) -> object:
            out = self.inner(*args, **kwargs)
            out.logits[..., -1] = float("-inf")
            return out

    evaluator.target = MaskedPadding(evaluator.target)
    assert not evaluator._is_tie(prompt, [top], [far])


def test_the_chi_square_pools_thin_bins_and_one_bin_tests_nothing() -> None:
    """Bins expecting 5 draws or more stand alone, the rest pool into one; a lone bin has nothing to test (p = 1)."""
    import numpy as np
    from scipy.stats import chisquare

    from pipeline.evaluation.evaluator import chi_square_first_token

    p = np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02, 0.0])
    counts = np.array([46, 33, 9, 7, 3, 2, 0])  # n = 100: the last three expect 3, 2 and 0: pooled into 5
    pvalue, bins = chi_square_first_token(counts, p)
    assert bins == 5 and pvalue == pytest.approx(chisquare([46, 33, 9, 7, 5], [50, 30, 10, 5, 5]).pvalue)
    skewed = np.array([100, 0, 0, 0, 0, 0, 0])
    assert chi_square_first_token(skewed, p)[0] < 1e-10
    flat = np.full(10, 0.1)
    assert chi_square_first_token(np.array([4, 0, 0, 0, 0, 0, 0, 0, 0, 0]), flat) == (1.0, 1)  # all pooled
    # an emitted token the target gives 0: the thin tail expecting nothing had its bin dropped, so these counts (the
    # fitting ones above, one draw moved to the last, impossible token) scored p = 0.82 as a fit
    impossible = np.array([46, 33, 9, 7, 3, 1, 1])
    assert chi_square_first_token(impossible, p) == (0.0, 5)
    assert chi_square_first_token(np.array([49, 1]), np.array([1.0, 0.0]))[0] == 0.0  # one bin would read p = 1


class UniformQ:
    """A proposer that reports a uniform q over the ``vocab`` target ids for each of its γ drafts. ``honest`` draws
    them from it (lossless); ``lossy`` drafts ``top`` every time (verification keeps it whenever the target gives it
    more than 1/V); ``silent`` drafts nothing."""

    name, target_layers = "uniform", ()

    def __init__(self, vocab: int, top: int, kind: str) -> None:
        self.vocab, self.top, self.kind = vocab, top, kind

    def reset(self) -> None:
        pass

    def propose(self, context, gamma, params, generator, state):  # noqa: ANN001, ANN201
        import torch

        from pipeline.engine.proposers import Proposal

        if self.kind == "silent":
            return Proposal([], None)
        tokens = (torch.randint(self.vocab, (gamma,), generator=generator).tolist() if self.kind == "honest"
                  else [self.top] * gamma)
        return Proposal(tokens, torch.full((gamma, self.vocab), 1.0 / self.vocab, dtype=torch.float64))


def test_the_first_token_check_fails_a_lossy_proposer_and_too_few_draws(tmp_path: Path, tiny_kit) -> None:
    """The evaluation's first-token check against a proposer that drafts uniformly and says so (lossless), one that
    always drafts the target's top token but reports a uniform q (lossy: verification accepts that token whenever it
    is drafted, so it is emitted every time), one that never drafts, and too few draws for two bins: it passes only
    the first, at 400 draws, and says why the others test nothing."""
    import torch

    from tests.helpers import kit_evaluator

    prompt = [5, 6, 7]
    build = kit_evaluator(tmp_path, "eager", "evaluate.max_new_tokens=4", "evaluate.sampling_check_samples=400")
    evaluator = build({"chat": [prompt]})
    with torch.no_grad():
        logits = evaluator.target(torch.tensor([prompt])).logits[0, -1]
    vocab, top = logits.numel(), int(logits.argmax())

    honest = evaluator.sampling_check("uniform", None, UniformQ(vocab, top, "honest"))
    lossy = evaluator.sampling_check("uniform", None, UniformQ(vocab, top, "lossy"))
    assert honest.passed and "n=400" in honest.detail, honest
    assert not lossy.passed and "first draft accepted in 400/400 draws" in lossy.detail, lossy
    # a proposer that never drafts emits the target's own samples, which pass the chi-square: a check of nothing
    silent = evaluator.sampling_check("uniform", None, UniformQ(vocab, top, "silent"))
    assert not silent.passed and "first-round drafts verified: 0 (a check with none" in silent.detail, silent
    few = kit_evaluator(tmp_path / "few", "eager", "evaluate.max_new_tokens=4",
                        "evaluate.sampling_check_samples=2")({"chat": [prompt]})
    vacuous = few.sampling_check("uniform", None, UniformQ(vocab, top, "honest"))
    assert not vacuous.passed and "over 1 bins" in vacuous.detail and "one bin tests nothing" in vacuous.detail, vacuous


def test_the_every_position_check_fails_a_lossy_proposer_and_one_that_never_drafts(tmp_path: Path, tiny_kit) -> None:
    """The evaluation's every-position check (evaluate.law_check_generations sampled generations at the largest γ)
    against a proposer that drafts γ uniform tokens and says so (lossless), one that drafts the prompt's top token γ
    times but reports a uniform q (lossy: verification keeps it whenever the target gives it more than 1/V), and one
    that never drafts (nothing to test): it passes only the first, and says why the others fail."""
    import torch

    from tests.helpers import kit_evaluator

    prompts = [[5, 6, 7], [5, 9, 11]]
    build = kit_evaluator(tmp_path, "eager", "evaluate.max_new_tokens=32", "evaluate.law_check_generations=12")
    evaluator = build({"chat": prompts})
    with torch.no_grad():
        logits = evaluator.target(torch.tensor([prompts[0]])).logits[0, -1]
    vocab, top = logits.numel(), int(logits.argmax())

    honest = evaluator.position_check("uniform", None, UniformQ(vocab, top, "honest"))
    assert honest.passed and "12 generations of up to 32 tokens at γ=3" in honest.detail, honest
    assert "draft-order z" in honest.detail and "FAILED" not in honest.detail, honest
    lossy = evaluator.position_check("uniform", None, UniformQ(vocab, top, "lossy"))
    assert not lossy.passed and re.search("FAILED: .*target-order z", lossy.detail), lossy
    silent = evaluator.position_check("uniform", None, UniformQ(vocab, top, "silent"))
    assert not silent.passed and "drafts verified: 0 (a check with none would be vacuous)" in silent.detail, silent


def test_metrics_are_sane(evaluated) -> None:
    _, artifact, results = evaluated
    for row in results["rows"]:
        assert row["tau"] >= 1.0 and row["tokens_per_s"] > 0
        if row["method"] == "ar":
            assert row["tau"] == 1.0 and row["speedup"] == pytest.approx(1.0)
        else:
            assert len(row["per_position_acceptance"]) == row["gamma"]
            assert 0.0 <= row["acceptance_rate"] <= 1.0
            assert row["tau"] <= row["gamma"] + 1
    same = [r for r in results["rows"] if r["method"] == "full"]
    assert any(r["tau"] > 1.1 for r in same), "the distilled same-tokenizer drafter must get drafts accepted"
    for row in results["rows"]:
        # byte-level rows count drafter calls: SLRS at most lookahead (3) per drafted token, and it computes
        # at least one psi row per call; SLEM's budget is 3 bytes per target token
        if row["method"] in ("slrs", "slem_bytes", "tli", "union", "slem"):
            assert row["drafter_calls_per_token"] > 0, row
        if row["method"] == "slrs":
            assert row["psi_rows_per_token"] >= row["drafter_calls_per_token"]
            assert row["drafter_calls_per_token"] * row["new_tokens"] <= 3 * row["gamma"] * row["target_forwards"]
        else:
            assert row.get("psi_rows_per_token") is None
    assert "## String-level rejection sampling (SLRS)" in artifact.file("report.md").read_text()
    assert set(p.name for p in artifact.path.iterdir()) >= {"report.json", "report.html", "report.md"}
    assert "<svg" in artifact.file("report.html").read_text()


def test_passing_bundle_is_registered_with_aliases(evaluated, mlflow_server: MlflowServer) -> None:
    cfg, artifact, results = evaluated
    assert results["gates"]["passed"], results["gates"]
    record = json.loads((artifact.path.parent / f"{artifact.id}.registration.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    version = client.get_model_version_by_alias(record["name"], "champion")
    assert version.version == str(record["version"])
    assert client.get_model_version_by_alias(record["name"], "candidate").version == version.version
    tags = version.tags
    assert tags["drafter.vocab_hash"] == artifact.fingerprint["vocab_hash"]
    assert artifact.id in tags["drafter.components"] and tags["drafter.gates.passed"] == "true"
    assert tags["git.sha"]
    # the evaluate run carries the report in MLflow
    exp = client.get_experiment_by_name(cfg.mlflow.experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`drafter.artifact_id` = '{artifact.id}'")
    assert len(runs) == 1 and runs[0].data.metrics["gates_passed"] == 1


def test_pull_round_trip_and_tampering(evaluated, mlflow_server: MlflowServer, tmp_path: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    cfg, artifact, _ = evaluated
    record = json.loads((artifact.path.parent / f"{artifact.id}.registration.json").read_text())
    common = [f"workdir={cfg.workdir}", f"mlflow.tracking_uri={mlflow_server.uri}"]
    dest = tmp_path / "pulled"
    assert cli(["pull", f"{record['name']}@champion", "--to", str(dest), "--expect-target", "tiny:test/target",
                *common]) == 0
    bundle = json.loads((dest / "bundle.json").read_text())
    assert {c["id"] for c in bundle["components"]} >= {artifact.id}
    # the revision a serving stack pins is checked too (a hub target's branch, tag or commit; here the kit's hash)
    pinned = ["--expect-target", "tiny:test/target", "--expect-revision"]
    assert cli(["pull", f"{record['name']}@champion", "--to", str(tmp_path / "pinned"), *pinned,
                artifact.fingerprint["revision"], *common]) == 0
    capsys.readouterr()
    assert cli(["pull", f"{record['name']}@champion", "--to", str(tmp_path / "repinned"), *pinned, "0" * 40,
                *common]) == 2
    assert f"revision={artifact.fingerprint['revision']}" in capsys.readouterr().err
    assert cli(["pull", f"{record['name']}@champion", "--to", str(tmp_path / "unnamed"), "--expect-revision",
                "0" * 40, *common]) == 2  # a revision of no named target
    assert "--expect-target MODEL" in capsys.readouterr().err and not (tmp_path / "unnamed").exists()
    # tamper with a payload in the server's artifact store: the pull must refuse and leave nothing behind
    stored = [p for p in (mlflow_server.root / "artifacts").rglob("shortlists.safetensors")]
    assert stored
    originals = {path: path.read_bytes() for path in stored}
    try:
        for path, blob in originals.items():
            data = bytearray(blob)
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        capsys.readouterr()
        assert cli(["pull", f"{record['name']}@champion", "--to", str(tmp_path / "evil"), *common]) == 2
        assert "shortlists.safetensors" in capsys.readouterr().err
        assert not (tmp_path / "evil").exists()
    finally:  # the server's store is shared with the other tests of this module (the EAGLE-3 bundle)
        for path, blob in originals.items():
            path.write_bytes(blob)
    # a bundle built for another target is refused
    assert cli(["pull", f"{record['name']}@champion", "--to", str(tmp_path / "other"), "--expect-target",
                "tiny:test/drafter_other", *common]) == 2


def test_eagle3_rows_sit_beside_simulated_tau_and_the_bundle_is_registered_and_pulled(
        evaluated, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    cfg, artifact, results = evaluated
    eagle3 = [r for r in results["rows"] if r["method"] == "eagle3"]
    assert {(r["task"], r["gamma"]) for r in eagle3} == {(t, g) for t in ("chat", "code") for g in (1, 4)}
    trained = results["eagle3_training"]
    assert trained["artifact"] == results["inputs"]["eagle3"] and trained["simulated_tau"] > 1.0
    report = artifact.file("report.md").read_text()
    assert "simulated τ (train_drafter, held-out)" in report and trained["artifact"] in report
    gates = results["eagle3_gates"]
    assert gates["chosen"]["shortlist"] is None and gates["chosen"]["gamma"] in (1, 4)
    assert gates["passed"], gates
    registration = artifact.path.parent / f"{artifact.id}.registration-eagle3.json"
    record = json.loads(registration.read_text())
    assert record["name"].endswith("-eagle3") and "champion" in record["aliases"]
    assert f"registered {record['name']} version {record['version']}" in cli_module._summary(cfg, {"evaluate": artifact})
    kept = registration.read_bytes()
    try:  # a damaged record: a line saying so in `drafter run`'s summary, where a JSONDecodeError ended the run
        for damage in (b"{not json", b"[1]"):
            registration.write_bytes(damage)
            assert f"{registration.name} is damaged: run again" in cli_module._summary(cfg, {"evaluate": artifact})
    finally:
        registration.write_bytes(kept)
    common = [f"workdir={cfg.workdir}", f"mlflow.tracking_uri={mlflow_server.uri}"]
    dest = tmp_path / "eagle3"
    assert cli(["pull", f"{record['name']}@champion", "--to", str(dest), "--expect-target", "tiny:test/target",
                *common]) == 0
    bundle = json.loads((dest / "bundle.json").read_text())
    assert {c["id"] for c in bundle["components"]} == {trained["artifact"], results["inputs"]["counts"], artifact.id}
    head = dest / "components" / trained["artifact"]
    for path in ("model.safetensors", "eagle3_config.json", "exports/eagle3/config.json",
                 "exports/eagle3/model.safetensors", "exports/speculators/config.json"):
        assert (head / path).is_file(), path


def test_failed_gates_register_nothing(tmp_path: Path, tiny_kit, mlflow_server: MlflowServer) -> None:
    cfg = eval_cfg(tmp_path, mlflow_server.uri, "evaluate.gate_tau_min=50", "evaluate.methods=[shortlist]",
                   "evaluate.sampling_check_samples=0",
                   "evaluate.law_check_generations=0", "evaluate.tasks=[code]", "evaluate.gammas=[2]",
                   "mlflow.experiment=gates-fail")
    artifact = run(cfg, ["evaluate"])["evaluate"]
    results = json.loads(artifact.file("report.json").read_text())
    assert not results["gates"]["passed"] and not results["gates"]["checks"]["tau_min"]["passed"]
    assert not (artifact.path.parent / f"{artifact.id}.registration.json").exists()


def test_shortlist_from_another_target_is_refused(tmp_path: Path, tiny_kit, mlflow_server: MlflowServer) -> None:
    other = run(load_config(None, [f"workdir={tmp_path}", *SMALL, "target.model=tiny:test/drafter_other",
                                   "generate.limit=4"]), ["count"])["count"]
    cfg = eval_cfg(tmp_path, mlflow_server.uri, f"evaluate.counts={other.path}")
    with pytest.raises(DrafterError, match="built for a different target") as err:
        evaluate.main(cfg)
    assert "vocab_hash" in str(err.value) and other.fingerprint["vocab_hash"] in str(err.value)


def test_shortlist_without_eos_is_refused(tmp_path: Path, tiny_kit, mlflow_server: MlflowServer) -> None:
    cfg = eval_cfg(tmp_path, mlflow_server.uri, "count.always_include_special=false", "count.top_k=[4]",
                   "evaluate.shortlists=[top_k_4]", "evaluate.methods=[shortlist]")
    with pytest.raises(DrafterError, match="(?i)eos"):
        run(cfg, ["evaluate"])


def test_drafter_with_another_tokenizer_cannot_use_same_vocab_methods(tmp_path: Path, tiny_kit) -> None:
    cfg = load_config(None, [f"workdir={tmp_path}", *SMALL, *EVAL, "evaluate.drafter=tiny:test/drafter_other"])
    with pytest.raises(DrafterError, match="does not share the target's tokenizer"):
        evaluate.main(cfg)


@pytest.mark.parametrize("gammas", ["[0]", "[-2]", "[]"])
def test_non_positive_gamma_is_a_config_error(gammas: str) -> None:
    with pytest.raises(DrafterError, match="evaluate.gammas"):
        load_config(None, [f"evaluate.gammas={gammas}"])


def test_dynaspec_rows_are_matched_and_their_bundle_registered(evaluated, mlflow_server: MlflowServer) -> None:
    """DynaSpec-F, DynaSpec-PA and PA-FR rows carry their budget, measured head rows per draft position
    (PA decays with position; each mean within a factor 2 of the FR-Spec shortlist it was matched to) and
    head time; the DynaSpec bundle (clusters + router + report) passes its gates and is registered."""
    cfg, artifact, results = evaluated
    policy = results["dynaspec_policy"]
    assert policy["match"] == "top_k_64" and policy["keep_ids"]
    for row in results["rows"]:
        if row["method"] in ("pa_fr", "dynaspec", "dynaspec_pa"):
            assert row["budget"] and row["head_ms_per_step"] > 0, row
            assert 0.5 * policy["match_size"] <= row["draft_vocab_mean"] <= 2 * policy["match_size"], row
            assert len(row["draft_vocab_per_position"]) == row["gamma"]
            if row["method"] != "dynaspec" and row["gamma"] == 4:
                assert row["draft_vocab_per_position"][0] > row["draft_vocab_per_position"][-1], row
        if row["method"] == "full":
            assert row["draft_vocab_mean"] == 1024  # the whole head
    assert results["dynaspec_gates"]["passed"], results["dynaspec_gates"]
    record = json.loads((artifact.path.parent / f"{artifact.id}.registration-dynaspec.json").read_text())
    assert record["name"].endswith("-dynaspec")
    version = MlflowClient(tracking_uri=mlflow_server.uri).get_model_version_by_alias(record["name"], "champion")
    components = version.tags["drafter.components"]
    assert results["inputs"]["cluster"] in components and results["inputs"]["train_router"] in components
    assert "Shortlists at matched size" in artifact.file("report.md").read_text()


def test_every_loader_runs_with_pickle_forbidden(evaluated, mlflow_server: MlflowServer, tmp_path: Path,
                                                  pickle_forbidden) -> None:
    """With pickle.load/loads/Unpickler and torch.load raising: every artifact in the workdir loads and verifies,
    and each kind's own loader (calibration rows, shortlists and ranking, the EAGLE-3 drafter, the clustering
    and its router, the report) and a registry pull run to the end."""
    from pipeline.artifacts import load_artifact
    from pipeline.data.calibration import iter_rows
    from pipeline.drafters.store import load_drafter
    from pipeline.dynaspec.clusters import Clustering
    from pipeline.dynaspec.router import load_router
    from pipeline.models.loading import load_model
    from pipeline.models.target import Target
    from pipeline.registry import pull
    from pipeline.vocab.counting import frequency_ranking, load_shortlists

    cfg, artifact, _ = evaluated
    loaded = {load_artifact(p).manifest["stage"]: load_artifact(p)
              for p in (cfg.workdir_path / "artifacts").iterdir() if p.is_dir() and not p.name.startswith(".")}
    assert set(loaded) >= {"generate", "count", "train_drafter", "cluster", "train_router", "evaluate"}
    assert list(iter_rows(loaded["generate"].path / "data"))
    assert load_shortlists(loaded["count"]) and frequency_ranking(loaded["count"]).size
    target = Target(cfg.target).model("cpu")
    load_drafter(loaded["train_drafter"].path, target)
    drafter = load_model(cfg.evaluate.drafter, dtype="float64", device="cpu")
    clustering = Clustering.load(loaded["cluster"].path)
    load_router(loaded["train_router"].path, clustering, drafter.get_output_embeddings().weight)
    assert json.loads(loaded["evaluate"].file("report.json").read_text())["rows"]
    record = json.loads((artifact.path.parent / f"{artifact.id}.registration.json").read_text())
    pulled = pull(f"{record['name']}@champion", tmp_path / "pulled", cfg.mlflow, tmp_path / "work")
    assert (pulled / "bundle.json").is_file()
