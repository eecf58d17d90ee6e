"""The estimate_rdk stage and the RDK rows of evaluate, end to end on the tiny kit's test profile: moments equal a
direct recomputation, the artifact's affinity equals the dense construction on the whole vocabulary, a kill -9
mid-estimation resumes to the same bytes, the RDK methods are lossless in evaluate and their bundle is registered
in a real MLflow server; bad input gives clear errors."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from jobs import evaluate, run
from pipeline.artifacts import ArtifactStore, ArtifactWriter, artifact_id
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import plan
from pipeline.rdk.affinity import Affinity, dense_affinity
from pipeline.rdk.moments import MOMENTS_FILE, MomentSums
from pipeline.rdk.prior import EXACT, INTERSECTION, PRUNED, RDKPrior
from tests.helpers import SMALL
from tests.killing import kill_when
from tests.mlflow_server import MlflowServer, serve

RDK = ["estimate_rdk.top_k=16", "estimate_rdk.shard_rows=2", "estimate_rdk.batch_size=2",
       "estimate_rdk.heldout_fraction=0.2", "estimate_rdk.keep_fractions=[0.05,0.01]",
       "estimate_rdk.taus=[1e-2,1e-3,1e-4]", "estimate_rdk.accelerator=cpu", "target.dtype=float64"]
TAUS = [1e-2, 1e-3, 1e-4]


def rdk_cfg(workdir: Path, *extra: str) -> PipelineConfig:
    return load_config(None, [f"workdir={workdir}", *SMALL, *RDK, *extra])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """This module's own server: its checks read which version holds `champion` of bundle names (…-rdk) that
    other files register on the worker's shared server too, in whatever order xdist runs them."""
    yield from serve(tmp_path_factory)


@pytest.fixture(scope="module")
def estimated(tmp_path_factory: pytest.TempPathFactory, tiny_kit):
    workdir = tmp_path_factory.mktemp("rdk")
    cfg = rdk_cfg(workdir)
    artifact = run(cfg, ["estimate_rdk"])["estimate_rdk"]  # builds generate and count first
    return cfg, artifact


def test_moments_equal_a_direct_recomputation(estimated) -> None:
    """μ and the top-k second moment equal one unbatched forward per training row (distributions are summed from
    float32 softmax outputs: 1e-6)."""
    from pipeline.data.rows import CalibrationRows
    from pipeline.models.loading import load_model
    from pipeline.orchestration.dag import plan

    cfg, artifact = estimated
    er = cfg.estimate_rdk
    calibration = plan(cfg, ["estimate_rdk"])["estimate_rdk"].input("generate")
    rows = CalibrationRows(calibration.path / "data", max_length=er.max_length, eval_fraction=er.heldout_fraction,
                           eval_max_rows=10**9, min_length=2, what="the RDK moments",
                           fraction_key="estimate_rdk.heldout_fraction").train
    target = load_model(cfg.target.model, dtype=cfg.target.dtype, device="cpu").eval()
    mu, second, n = None, {}, 0
    with torch.no_grad():
        for r in rows:
            logits = target(torch.tensor([r.input_ids])).logits[0]
            for t in range(1, len(r.input_ids)):
                if r.loss_mask[t]:
                    p = torch.softmax(logits[t - 1], -1).double()
                    mu = p if mu is None else mu + p
                    vals, idx = p.topk(er.top_k)
                    for a, va in zip(idx.tolist(), vals.tolist()):
                        for b, vb in zip(idx.tolist(), vals.tolist()):
                            second[(a, b)] = second.get((a, b), 0.0) + va * vb
                    n += 1
    moments = MomentSums.load(artifact.path / MOMENTS_FILE).moments()
    assert moments.count == n and moments.nnz == len(second)
    torch.testing.assert_close(moments.mu, mu / n, rtol=0, atol=1e-6)
    direct = torch.tensor([second[(int(a), int(b))] / n for a, b in zip(moments.rows, moments.cols)], dtype=torch.float64)
    torch.testing.assert_close(moments.vals, direct, rtol=0, atol=1e-6)


def test_artifact_affinity_equals_the_dense_construction_on_the_whole_vocabulary(estimated) -> None:
    """Every kept set's affinity at its chosen τ (and at the smallest of the grid) against softmax((S − μμᵀ)/τ)
    built densely over all 1,024 target tokens: max abs error below 1e-12."""
    _, artifact = estimated
    prior = RDKPrior.load(artifact.path)
    assert set(prior.levels) == {"keep_0.05", "keep_0.01", INTERSECTION}
    for name, fit in prior.levels.items():
        for tau in {fit.tau, min(TAUS)}:
            sparse = Affinity(prior.moments, fit.kept, tau).dense_rows()
            error = float((sparse - dense_affinity(prior.moments, fit.kept, tau)).abs().max())
            assert error < 1e-12, (name, tau, error)


def test_analysis_table_and_figures(estimated) -> None:
    """rdk.json: per kept set, τ from the grid with its whole curve, α of every method in [0, 1], EOS kept in the
    pruning levels, and the code half (HumanEval solutions) scored with the chat choices; the throughput and the
    memory the sparse form saves against a dense |T|² matrix."""
    cfg, artifact = estimated
    record = json.loads(artifact.file("rdk.json").read_text())
    from pipeline.models.loading import load_tokenizer

    eos = load_tokenizer(cfg.target.model).eos_token_id
    prior = RDKPrior.load(artifact.path)
    for name, level in record["levels"].items():
        assert level["tau"] in TAUS and [c["tau"] for c in level["tau_curve"]] == TAUS
        assert set(level["alpha"]) == {"tli", "rdk", "rdk_taylor", "rdk_prior_constant", "rdk_prior_confidence",
                                       "oracle_taylor"}
        assert all(0.0 <= a <= 1.0 for a in level["alpha"].values()), level["alpha"]
        assert level["positions"]["test"] >= 10
        code = level["code"]
        assert code["tau"] == level["tau"] and set(code["alpha"]) == set(level["alpha"]), code
        assert all(0.0 <= a <= 1.0 for a in code["alpha"].values()) and code["positions"] >= 10
        assert [c["tau"] for c in code["tau_curve"]] == TAUS
        assert artifact.metrics[f"{name}.code.alpha.tli"] == round(code["alpha"]["tli"], 6)
        if name != INTERSECTION:
            assert eos in prior.level(name).kept.tolist()
    assert record["levels"]["keep_0.01"]["size"] < record["levels"]["keep_0.05"]["size"] < 1024
    assert record["sparse_bytes"] < record["dense_bytes"] and 0 < record["covered"] <= 1
    assert artifact.metrics["contexts_per_s"] > 0 and artifact.metrics["positions"] == record["count"]


def test_answer_positions_are_numbered_by_the_chat_they_come_from() -> None:
    """RDK's analysis chooses on some held-out chats and scores on the others; a row's positions carry the number
    of its chat (first appearance), parts of one chat share it, and a row without a group is a chat of its own."""
    from jobs.estimate_rdk import answer_chats
    from pipeline.data.rows import Row

    rows = [Row(0, [5, 6, 7, 8], [0, 1, 1, 0], "a"), Row(1, [5, 6, 7], [0, 0, 1], "b"), Row(2, [5, 6], [0, 1], "a"),
            Row(3, [5, 6, 7], [0, 1, 1]), Row(4, [5, 6], [0, 1])]
    assert answer_chats(rows) == [0, 0, 1, 0, 2, 2, 3]


def test_the_analysed_positions_spread_over_every_held_out_chat(estimated) -> None:
    """heldout_max_positions kept the first positions, a few chats' answers (one chat's at the 8B config's 1,024-token
    answers), and every held-out row's full-vocabulary distributions were computed before the cut. The cap now
    spreads evenly over all positions, and only the picked positions' distributions are computed: they equal the
    full computation's rows at those positions."""
    from jobs.estimate_rdk import answer_chats, answer_distributions, spread
    from pipeline.data.rows import CalibrationRows
    from pipeline.models.loading import load_model

    cfg, artifact = estimated
    calibration = artifact.path.parent / json.loads(artifact.file("rdk.json").read_text())["calibration"]
    rows = CalibrationRows(calibration / "data", max_length=cfg.estimate_rdk.max_length,
                           eval_fraction=cfg.estimate_rdk.heldout_fraction, eval_max_rows=10**9, min_length=2,
                           what="the RDK moments", fraction_key="estimate_rdk.heldout_fraction").heldout
    chats = answer_chats(rows)
    order = spread(len(chats), 32)
    assert len(order) == 32 == len(set(order)) and order == sorted(order) and len(chats) > 64
    assert {chats[i] for i in order} == set(chats)  # every held-out chat keeps a share (the first 32: only a few)
    assert len({chats[i] for i in range(32)}) < len(set(chats))
    assert spread(5, 8) == [0, 1, 2, 3, 4]
    model = load_model(cfg.target.model, dtype="float32", device="cpu").eval()
    full = answer_distributions(model, rows, 3, "cpu")
    picked = answer_distributions(model, rows, 3, "cpu", set(order))
    torch.testing.assert_close(picked, full[order], rtol=0, atol=0)


def test_killed_estimation_resumes_to_the_same_bytes(estimated, tmp_path: Path) -> None:
    """kill -9 after the first shard's sums land; the rerun keeps the landed shards (resumed_shards > 0) and
    publishes moments byte-identical to an uninterrupted run."""
    cfg, clean = estimated
    workdir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jobs.cli", "estimate_rdk", f"workdir={workdir}", *SMALL, *RDK]
    kill_when(cmd, workdir, "staging/estimate_rdk-*/sums-*.safetensors", stage="estimate_rdk")
    resumed = run(rdk_cfg(workdir), ["estimate_rdk"])["estimate_rdk"]
    assert resumed.id == clean.id and resumed.metrics["resumed_shards"] > 0
    assert (resumed.path / MOMENTS_FILE).read_bytes() == (clean.path / MOMENTS_FILE).read_bytes()


def _stop_before_publishing(*_args, **_kwargs) -> None:
    raise RuntimeError("stopped before publishing")


def test_damaged_moment_shards_are_redone_to_the_same_bytes(estimated, tmp_path: Path, monkeypatch, capsys) -> None:
    """An estimation stopped after staging its moment shards, before publishing; one staged shard gets a flipped
    byte, another is truncated. The rerun redoes exactly those two, with a line naming each, and publishes moments
    byte-identical to an uninterrupted run (before checksums both were merged as found, or failed in safetensors)."""
    cfg, clean = estimated
    workdir = tmp_path / "stopped"
    step = plan(cfg, ["estimate_rdk"])["estimate_rdk"]
    for up in ("generate", "count"):  # the upstream artifacts as they are: only estimate_rdk runs here
        shutil.copytree(step.inputs[up][1], workdir / "artifacts" / step.inputs[up][0])
    with monkeypatch.context() as patch:
        patch.setattr(ArtifactWriter, "commit", _stop_before_publishing)
        with pytest.raises(RuntimeError, match="stopped before publishing"):
            run(rdk_cfg(workdir), ["estimate_rdk"])
    staged = sorted(workdir.glob("staging/estimate_rdk-*/sums-*.safetensors"))
    assert len(staged) >= 3
    flipped, truncated = staged[0], staged[-1]
    data = bytearray(flipped.read_bytes())
    data[-8] ^= 0x01  # inside the last tensor's values
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    capsys.readouterr()
    resumed = run(rdk_cfg(workdir), ["estimate_rdk"])["estimate_rdk"]
    err = capsys.readouterr().err
    assert f"{flipped.name}: sha256 mismatch (expected " in err and f"{truncated.name}: truncated (" in err, err[-3000:]
    assert resumed.id == clean.id and resumed.metrics["resumed_shards"] == len(staged) - 2
    assert (resumed.path / MOMENTS_FILE).read_bytes() == (clean.path / MOMENTS_FILE).read_bytes()


RDK_EVAL = ["evaluate.methods=[pruned,rdk,rdk_taylor,rdk_prior,tli_rdk]", "evaluate.rdk_levels=[keep_0.01]",
            "evaluate.tasks=[chat]", "evaluate.prompts_per_task=2", "evaluate.max_new_tokens=16",
            "evaluate.max_prompt_tokens=64", "evaluate.gammas=[2]", "evaluate.tie_tolerance=0",
            "evaluate.sampling_check_samples=200", "evaluate.gate_tau_min=1.0", "evaluate.gate_speed_min=0.1",
            "mlflow.experiment=rdk-tests"]


def test_rdk_rows_are_lossless_and_their_bundle_registered(estimated, mlflow_server: MlflowServer) -> None:
    """evaluate with the RDK methods (one decoded level, evaluate.rdk_levels): a row per method, greedy output equal
    to autoregressive on every prompt, the first-token law check passes for each, the report carries the analysis
    of every level, and the RDK bundle (estimate_rdk artifact + report) is registered with its components."""
    from mlflow.tracking import MlflowClient

    cfg, rdk_artifact = estimated
    cfg = load_config(None, [f"workdir={cfg.workdir}", *SMALL, *RDK, *RDK_EVAL, f"mlflow.tracking_uri={mlflow_server.uri}"])
    artifact = run(cfg, ["evaluate"])["evaluate"]
    results = json.loads(artifact.file("report.json").read_text())
    got = {(r["method"], r["shortlist"]) for r in results["rows"] if r["method"] != "ar"}
    assert got == {(m, "keep_0.01") for m in ("pruned", "rdk", "rdk_taylor", "rdk_prior")} | {("tli_rdk", None)}
    assert all(r["greedy_equal"] for r in results["rows"]), results["rows"]
    checks = [c for c in results["lossless"]["checks"] if c["name"].startswith("first_token_distribution")]
    assert len(checks) == 5 and all(c["passed"] for c in results["lossless"]["checks"])
    assert results["inputs"]["estimate_rdk"] == rdk_artifact.id
    assert set(results["rdk_analysis"]["levels"]) == {"keep_0.05", "keep_0.01", INTERSECTION}
    assert results["rdk_gates"]["passed"], results["rdk_gates"]
    report = artifact.file("report.md").read_text()
    assert "Out-of-vocabulary drafting (RDK)" in report and "| keep_0.01 |" in report
    assert {r.split("|")[3].strip() for r in report.splitlines() if r.startswith("| keep_0.01 |")} == {"chat", "code"}
    record = json.loads((artifact.path.parent / f"{artifact.id}.registration-rdk.json").read_text())
    assert record["name"].endswith("-rdk")
    version = MlflowClient(tracking_uri=mlflow_server.uri).get_model_version_by_alias(record["name"], "champion")
    assert rdk_artifact.id in version.tags["drafter.components"]


def test_bad_input_is_refused(estimated, tmp_path: Path) -> None:
    """A τ ≤ 0 or a pruning level outside (0, 1] in the config, a code analysis that would reuse the HumanEval
    problems evaluate decodes, and an evaluate.rdk that is not an estimate_rdk artifact: clear errors."""
    with pytest.raises(DrafterError, match="estimate_rdk.taus"):
        rdk_cfg(tmp_path, "estimate_rdk.taus=[0.0]")
    with pytest.raises(DrafterError, match="estimate_rdk.keep_fractions"):
        rdk_cfg(tmp_path, "estimate_rdk.keep_fractions=[0]")
    cfg, _ = estimated
    overlap = load_config(None, [f"workdir={cfg.workdir}", *SMALL, *RDK, "estimate_rdk.code_problems=160",
                                 "evaluate.prompts_per_task=8"])
    with pytest.raises(DrafterError, match=r"code_problems \+ evaluate.prompts_per_task <= 164"):
        run(overlap, ["estimate_rdk"])
    counts_dir = next(p for p in Path(cfg.workdir, "artifacts").glob("count-*") if p.is_dir())
    bad = rdk_cfg(tmp_path, f"evaluate.rdk={counts_dir}", "evaluate.methods=[rdk]")
    with pytest.raises(DrafterError, match="rdk_affinity|kind"):
        evaluate.main(bad)


def test_a_same_tokenizer_drafter_with_another_vocabulary_is_refused_before_any_work(estimated, tmp_path: Path,
                                                                                    tiny_kit, capsys) -> None:
    """estimate_rdk indexes evaluate.drafter's distributions with target ids: a drafter with another tokenizer died
    with a raw IndexError after the whole moment pass. Its vocabulary is compared with the target's when the stage is
    planned (nothing runs, not even generate); where the two hashes are not comparable (a tiny-kit target, a drafter
    in a local directory) the stage compares the tokenizers before its moment pass."""
    other = ["evaluate.drafter_other=null"]
    with pytest.raises(DrafterError, match=r"evaluate\.drafter(.|\n)*tiny:test-[0-9a-f]+/metaspace(.|\n)*"
                                           r"evaluate\.drafter_other"):
        run(rdk_cfg(tmp_path, "evaluate.drafter=tiny:test/drafter_other", *other), ["estimate_rdk"])
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").iterdir())
    cfg, _ = estimated  # its generate and count are reused: only estimate_rdk runs
    local = rdk_cfg(Path(cfg.workdir), f"evaluate.drafter={tiny_kit.path('drafter_other')}", *other)
    capsys.readouterr()
    with pytest.raises(DrafterError, match=r"estimate_rdk reads the drafter(.|\n)*evaluate\.drafter"):
        run(local, ["estimate_rdk"])
    logged = "".join(capsys.readouterr())
    assert "estimate_rdk: " not in logged.replace("estimate_rdk: cache", "") or " shards" not in logged, logged
    assert "moments of" not in logged  # refused before the moment pass (it logs its shards, then its moments)


@pytest.mark.parametrize("source", ["sharegpt", "humaneval"])
def test_code_rows_keep_to_unseen_problems_and_to_the_models_context(tmp_path: Path, tiny_kit, source: str) -> None:
    """The α table's code rows: the last problems that no calibration row holds and the evaluation does not decode
    (with generate.source=humaneval the calibration set holds every problem outside its held-out share: the rows
    came from those, and the overlap check counted evaluate's problems as the first ones, which they are not there),
    each cut to the context of the target and the drafter (prompt + canonical solution ran past the test kit's 128
    positions, which RoPE extrapolates silently). How prompts are cut enters estimate_rdk's id."""
    from jobs.estimate_rdk import _code_rows
    from pipeline.data.calibration import encode_prompt
    from pipeline.data.sources import load_humaneval, split_heldout
    from pipeline.models.target import Target

    cfg = rdk_cfg(tmp_path, f"generate.source={source}", "generate.heldout_fraction=0.3",
                  "evaluate.prompts_per_task=4", "estimate_rdk.code_problems=6", "evaluate.max_prompt_tokens=64")
    tokenizer = Target(cfg.target).tokenizer()
    drawn_config = {"generate": {"source": source, "heldout_fraction": 0.3}}  # how the calibration set was drawn
    writer = ArtifactStore(tmp_path / "drawn").writer(artifact_id("generate", drawn_config, [], {"model": "m"}),
                                                      kind="calibration", stage="generate", config=drawn_config,
                                                      inputs=[], fingerprint={"model": "m"})
    (writer.tmp / "rows.txt").write_text("a calibration set's payload")
    drawn = writer.commit({})
    rows = _code_rows(cfg, tokenizer, drawn)
    # a calibration set named by path (estimate_rdk.calibration) says how it was drawn: a config whose own generate
    # section names another source took every problem as unseen, the ones the set was drawn from included
    other = rdk_cfg(tmp_path, f"generate.source={'humaneval' if source == 'sharegpt' else 'sharegpt'}",
                    "generate.heldout_fraction=0.3", "evaluate.prompts_per_task=4", "estimate_rdk.code_problems=6",
                    "evaluate.max_prompt_tokens=64")
    assert [r.input_ids for r in _code_rows(other, tokenizer, drawn)] == [r.input_ids for r in rows]
    everything = load_humaneval()
    unseen = split_heldout(everything, 0.3, heldout=True) if source == "humaneval" else everything
    calibrated = set() if source == "sharegpt" else {c.id for c in split_heldout(everything, 0.3, heldout=False)}
    expected = unseen[-6:]
    assert not {c.id for c in expected} & (calibrated | {c.id for c in unseen[:4]})
    assert len(rows) == 6
    for row, problem in zip(rows, expected):
        prompt = encode_prompt(tokenizer, problem.messages, 64)
        assert row.input_ids[: len(prompt)] == prompt, problem.id
    assert max(len(r.input_ids) for r in rows) == 128  # the test kit's context: at least one row was cut there
    ids = [plan(rdk_cfg(tmp_path, extra), ["estimate_rdk"])["estimate_rdk"].id
           for extra in ("evaluate.max_prompt_tokens=64", "evaluate.max_prompt_tokens=48")]
    assert ids[0] != ids[1]
    # the overlap is refused at plan time, for a cached estimate_rdk too (evaluate's settings are not in its id)
    with pytest.raises(DrafterError, match=r"code_problems \+ evaluate.prompts_per_task <= "):
        plan(rdk_cfg(tmp_path, f"generate.source={source}", "generate.heldout_fraction=0.3",
                     "evaluate.prompts_per_task=4", f"estimate_rdk.code_problems={len(unseen) - 3}"), ["estimate_rdk"])


def test_rdk_artifact_loads_with_pickle_forbidden(estimated, pickle_forbidden) -> None:
    """The estimate_rdk artifact (moments, kept sets, tau, weights) loads and transforms with pickle.load/loads/
    Unpickler and torch.load raising."""
    from pipeline.artifacts import load_artifact

    _, artifact = estimated
    prior = RDKPrior.load(load_artifact(artifact.path).path)
    names = prior.names(PRUNED)
    assert names, "no pruning level to transform"
    for name in names:
        assert prior.transform(EXACT, name) is not None and len(prior.level(name).kept) > 0, name
