"""The stage DAG and its plan: ids hold exactly what changes a result, computed without running anything.

Covers the defects found on review: run settings (devices, nodes, accelerator, workers) used to enter
ids, so the README's Slurm chain regenerated the calibration set on the count node; ``target.dtype`` was
not in the id; ``evaluate`` with ``evaluate.counts=PATH`` ignored where its prompts come from; and
``generate`` tokenised prompts without ``target.tokenizer`` / ``target.revision``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import count, generate, run
from jobs.cli import main as cli_main
from pipeline.config.sections import load_config
from pipeline.data.calibration import iter_rows
from pipeline.engine.methods import METHOD_NAMES, METHODS
from pipeline.errors import DrafterError
from pipeline.orchestration import dag
from pipeline.orchestration.dag import STAGE_NAMES, STAGES, default_stages, plan
from pipeline.orchestration.launching import check_one_multi_rank_stage
from pipeline.orchestration.lock import Launch
from pipeline.registry.bundle import Bundle, verify_bundle, write_bundle
from tests.helpers import SMALL, small_cfg

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_is_a_dag_in_order() -> None:
    seen: set[str] = set()
    for row in STAGES:
        assert set(row.upstream) <= seen, f"{row.name} must come after its upstream stages"
        assert set(row.overrides) <= set(row.upstream)
        assert row.job == f"jobs.{row.name}" and (ROOT / "jobs" / f"{row.name}.py").is_file()
        seen.add(row.name)


def test_plan_runs_nothing_and_follows_the_cache(tmp_path: Path, tiny_kit) -> None:
    cfg = small_cfg(tmp_path)
    before = plan(cfg, ["count"])
    assert [s["status"] for s in before.table()] == ["to run", "to run"]
    assert before.needed(["count"]) == ["generate", "count"]
    assert before["count"].inputs["generate"][0] == before["generate"].id
    assert not tmp_path.exists() or not any(tmp_path.iterdir()), "planning must not write anything"
    built = generate.main(cfg)
    after = plan(cfg, ["count"])
    assert built.id == after["generate"].id and after["generate"].cached
    assert after.needed(["count"]) == ["count"]  # count alone reuses the calibration set


def test_a_stages_version_rebuilds_it_and_everything_downstream(tmp_path: Path, tiny_kit,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids hash the config, the inputs and the target, not the code: a fix that made count write other shortlists
    from the same calibration set found the old ones cached and registered them under the new commit."""
    cfg = small_cfg(tmp_path)
    before = {name: step.id for name, step in plan(cfg).stages.items()}
    version = next(row.version for row in dag.STAGES if row.name == "count") + 1
    bumped = tuple(dataclasses.replace(row, version=version) if row.name == "count" else row for row in dag.STAGES)
    monkeypatch.setattr(dag, "STAGES", bumped)
    after = plan(cfg).stages
    assert after["count"].config["stage_version"] == version
    downstream = {"count", "train_drafter", "train_router", "estimate_rdk", "evaluate"}
    assert {name for name in before if before[name] != after[name].id} == downstream


def test_run_settings_stay_out_of_every_id(tmp_path: Path, tiny_kit) -> None:
    here = small_cfg(tmp_path, "generate.devices=1", "generate.accelerator=cpu", "generate.num_nodes=1",
                     "count.workers=1", "evaluate.register=true", "estimate_rdk.devices=1",
                     "estimate_rdk.accelerator=cpu")
    there = small_cfg(tmp_path, "generate.devices=8", "generate.accelerator=gpu", "generate.num_nodes=4",
                      "count.workers=16", "evaluate.register=false", "evaluate.promote=true",
                      "target.trust_remote_code=true", "mlflow.experiment=elsewhere", "estimate_rdk.devices=8",
                      "estimate_rdk.accelerator=gpu", "estimate_rdk.num_nodes=2")
    a, b = plan(here), plan(there)
    assert [s.id for s in a.stages.values()] == [s.id for s in b.stages.values()]
    assert list(a.stages) == list(default_stages(here)) == [s for s in STAGE_NAMES if s != "train_dflash"]


def test_train_dflash_reads_count_only_with_its_own_draft_vocabulary_head(tmp_path: Path, tiny_kit) -> None:
    """head target: train_dflash reads generate alone; head draft: count too (its draft vocabulary), under another id;
    train_dflash.counts names the count artifact instead. A head that is neither is refused with the key."""
    target_head = plan(small_cfg(tmp_path), ["train_dflash"])
    draft_head = plan(small_cfg(tmp_path, "train_dflash.head=draft"), ["train_dflash"])
    assert list(target_head["train_dflash"].inputs) == ["generate"]
    assert list(draft_head["train_dflash"].inputs) == ["generate", "count"]
    assert draft_head["train_dflash"].inputs["count"][0] == draft_head["count"].id
    assert draft_head.needed(["train_dflash"]) == ["generate", "count", "train_dflash"]
    assert target_head["train_dflash"].id != draft_head["train_dflash"].id
    with pytest.raises(DrafterError, match="train_dflash.head"):
        small_cfg(tmp_path, "train_dflash.head=tied")


@pytest.mark.slow
def test_one_and_two_ranks_write_the_same_artifact(tmp_path: Path, tiny_kit) -> None:
    """Generate on 2 CPU ranks (Lightning DDP, a real second process) and on 1: one id, the same rows."""
    extra = ["generate.limit=24", "generate.max_new_tokens=10"]
    one = generate.main(small_cfg(tmp_path / "one", *extra, "generate.devices=1"))
    cmd = [sys.executable, "-m", "jobs.cli", "generate", f"workdir={tmp_path / 'two'}", *SMALL, *extra,
           "generate.devices=2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generate: 2 rank(s) on 1 node(s)" in done.stderr  # really two ranks
    two = plan(small_cfg(tmp_path / "two", *extra, "generate.devices=2"), ["generate"])["generate"]
    assert two.cached and two.id == one.id
    assert list(iter_rows(two.path / "data")) == list(iter_rows(one.path / "data"))


def test_dtype_is_part_of_what_a_stage_computes(tmp_path: Path, tiny_kit) -> None:
    f32, f64 = plan(small_cfg(tmp_path)), plan(small_cfg(tmp_path, "target.dtype=float64"))
    for stage in ("generate", "evaluate"):
        assert f32[stage].id != f64[stage].id, f"{stage} runs the target, so its dtype changes the result"
        assert f64[stage].config["target.dtype"] == "float64"
    assert "target.dtype" not in f32["count"].config  # counting never runs the model
    assert f32["count"].id != f64["count"].id  # but it counts another calibration set


def test_evaluate_id_follows_its_prompts_even_with_explicit_counts(tmp_path: Path, tiny_kit) -> None:
    no_head = "evaluate.methods=[full,shortlist,tli]"  # eagle3 would plan train_drafter (see test_train_drafter)
    cfg = small_cfg(tmp_path, no_head)
    generate.main(cfg)
    counts = count.main(cfg)
    named = [f"evaluate.counts={counts.path}", no_head]
    base = plan(small_cfg(tmp_path, *named), ["evaluate"])
    assert list(base.stages) == ["evaluate"] and base["evaluate"].inputs["count"][0] == counts.id
    assert base["evaluate"].id == plan(cfg, ["evaluate"])["evaluate"].id  # the path itself is not hashed
    other_source = plan(small_cfg(tmp_path, *named, "generate.source=humaneval"), ["evaluate"])
    # a smaller held-out share lies inside the one the counts kept out (shares are nested)
    other_split = plan(small_cfg(tmp_path, *named, "generate.heldout_fraction=0.02"), ["evaluate"])
    assert len({base["evaluate"].id, other_source["evaluate"].id, other_split["evaluate"].id}) == 3


@pytest.mark.parametrize("override", [
    "generate.heldout_fraction=0.2",  # chat: three quarters of these prompts were counted
    "evaluate.tasks=[code]",  # code: every HumanEval problem, and the counts drew on all but 5 % of them
])
def test_an_evaluation_of_named_artifacts_built_from_its_own_prompts_is_refused(tmp_path: Path, tiny_kit,
                                                                               override: str) -> None:
    """An artifact named by path was scored on whatever prompts this config holds out, though its calibration set
    may have been drawn with another split: trained on all but 5 % of the conversations, it was evaluated on 20 %,
    most of them seen, and the inflated τ gated and registered."""
    no_head = "evaluate.methods=[full,shortlist,tli]"
    source = "generate.source=humaneval" if "code" in override else "generate.source=sharegpt"
    cfg = small_cfg(tmp_path, no_head, source)
    calibration = generate.main(cfg)
    counts = count.main(cfg)
    named = [f"evaluate.counts={counts.path}", no_head]
    evaluated = ["generate.source=sharegpt", override] if "code" in override else [source, override]
    with pytest.raises(DrafterError, match="prompts include conversations") as err:
        plan(small_cfg(tmp_path, *named, *evaluated), ["evaluate"])
    assert str(counts.path) in err.value.problem and calibration.id in err.value.expected
    # the same artifact through count.calibration, one stage further up
    with pytest.raises(DrafterError, match="prompts include conversations"):
        plan(small_cfg(tmp_path, no_head, f"count.calibration={calibration.path}", *evaluated), ["evaluate"])
    # evaluated on the split it was built with, it plans
    plan(small_cfg(tmp_path, *named, source), ["evaluate"])


def test_a_named_artifacts_prompts_are_recognised_after_rows_were_added_to_their_file(tmp_path: Path,
                                                                                        tiny_kit) -> None:
    """The split hashes each conversation's id, so a file that gained rows since the counts were made still holds
    every conversation they were made from; the check compared the file's content and let the overlap through."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"Question {i}: what is {i} times {i}?"},
                               {"from": "gpt", "value": "ok"}]} for i in range(40)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    no_head = ["evaluate.methods=[full,shortlist,tli]", "evaluate.tasks=[chat]", f"generate.source={prompts}"]
    cfg = small_cfg(tmp_path, *no_head)
    generate.main(cfg)
    counts = count.main(cfg)
    with prompts.open("a") as fh:
        fh.write(json.dumps({"conversations": [{"from": "human", "value": "One more question?"}]}) + "\n")
    named = [*no_head, f"evaluate.counts={counts.path}"]
    with pytest.raises(DrafterError, match="chat prompts include conversations"):
        plan(small_cfg(tmp_path, *named, "generate.heldout_fraction=0.5"), ["evaluate"])
    plan(small_cfg(tmp_path, *named), ["evaluate"])  # the share the counts held out: sound


def test_an_evaluation_leaves_out_prompts_a_named_calibration_set_holds_however_its_source_moved(
        tmp_path: Path, tiny_kit) -> None:
    """Whether a part-numbered record (``<base>_<n>``) groups with its chat depends on how many records the file holds
    (``PART_GROUP_SHARE``), so rows added to a prompt file move one across the split, and a renamed copy escapes the
    plan's check by name: the evaluation decoded a prompt the counts' calibration set was built from. A calibration
    set now lists its prompts' digests, and an evaluation leaves those out, whatever its source is called."""
    from pipeline.data.calibration import PROMPT_DIGESTS, encode_prompt
    from pipeline.data.sources import heldout_score
    from pipeline.evaluation.matrix import eval_prompts, prompts_seen
    from pipeline.models.target import Target

    share = 0.05
    base = next(f"chat{i}" for i in range(100_000) if heldout_score(f"chat{i}") < share <= heldout_score(f"chat{i}_0"))

    def record(cid: str, question: str) -> dict:
        return {"id": cid, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "ok"}]}

    chat = [record(f"{base}_0", "Part zero of a long chat?"), record(f"{base}_1", "Part one of a long chat?")]
    filler = [record(f"other-{i}", f"Filler question {i}?") for i in range(250)]
    first, grown = tmp_path / "prompts.jsonl", tmp_path / "prompts-2.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in chat + filler[:150]))  # 152 records: 1 part a group
    grown.write_text("".join(json.dumps(r) + "\n" for r in chat + filler))  # renamed, and 2 parts now group
    setting = ["generate.kind=raw", f"generate.heldout_fraction={share}", "evaluate.methods=[full,shortlist,tli]",
               "evaluate.tasks=[chat]"]
    cfg = small_cfg(tmp_path, *setting, f"generate.source={first}")
    calibration = generate.main(cfg)
    counts = count.main(cfg)
    assert f"{base}_0" in {row["prompt_id"] for row in iter_rows(calibration.path / "data")}
    assert len(json.loads(calibration.file(PROMPT_DIGESTS).read_text())["digests"]) == 40  # generate.limit
    later = small_cfg(tmp_path, *setting, f"generate.source={grown}", f"evaluate.counts={counts.path}")
    plan(later, ["evaluate"])  # the plan's check compares sources by name or content: it cannot see this
    tokenizer = Target(later.target).tokenizer()
    leaked = encode_prompt(tokenizer, [{"role": "user", "content": "Part zero of a long chat?"}], 10_000)
    assert leaked in eval_prompts(later, tokenizer)["chat"]  # what the evaluation decoded
    seen, sets = prompts_seen([counts], later.workdir_path / "artifacts")
    assert sets == [calibration.id]
    lines: list[str] = []
    assert leaked not in eval_prompts(later, tokenizer, lines.append, seen)["chat"]
    assert any("2 held-out chat prompt(s) left out" in line for line in lines), lines  # both parts
    digests = calibration.file(PROMPT_DIGESTS)  # emptied, to let the prompts through: refused
    digests.chmod(0o644)
    digests.write_text(json.dumps({"digests": []}))
    with pytest.raises(DrafterError, match="not the file its calibration set's manifest lists"):
        prompts_seen([counts], later.workdir_path / "artifacts")


def test_a_pulled_bundles_lineage_names_the_split_its_artifacts_were_built_from(tmp_path: Path, tiny_kit) -> None:
    """A bundle ships the manifests of what its components were built from (``lineage/``), so the held-out check sees
    behind an artifact named inside a pulled copy, in a workdir that never held its calibration set: before, it found
    no manifest there and let an evaluation on a wider split through. The lineage is hashed like every bundle file."""
    no_head = "evaluate.methods=[full,shortlist,tli]"
    cfg = small_cfg(tmp_path / "built", no_head)
    calibration = generate.main(cfg)
    counts = count.main(cfg)
    bundle = Bundle(name="drafter-test-shortlist", artifacts=[counts], metrics={"tau": 1.0}, primary_metric="tau",
                    gates={"passed": True, "checks": {}}, fingerprint=counts.fingerprint)
    written = write_bundle(bundle, tmp_path / "registry-copy")
    pulled = tmp_path / "pulled"
    shutil.copytree(written, pulled)  # what `drafter pull` leaves after downloading the version's files
    assert (pulled / "lineage" / calibration.id / "manifest.json").is_file()
    verify_bundle(pulled)
    named = [no_head, f"evaluate.counts={pulled / 'components' / counts.id}"]
    elsewhere = tmp_path / "consumer"
    with pytest.raises(DrafterError, match="chat prompts include conversations") as err:
        plan(small_cfg(elsewhere, *named, "generate.heldout_fraction=0.2"), ["evaluate"])
    assert calibration.id in err.value.expected
    plan(small_cfg(elsewhere, *named), ["evaluate"])  # the split the counts held out: sound
    lineage = pulled / "lineage" / calibration.id / "manifest.json"
    lineage.write_text(lineage.read_text().replace('"heldout_fraction": 0.05', '"heldout_fraction": 0.5'))
    with pytest.raises(DrafterError, match=f"lineage/{calibration.id}/manifest.json' was modified"):
        verify_bundle(pulled)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_evaluate_reads_exactly_what_its_methods_registry_entry_needs(tmp_path: Path, tiny_kit, method: str) -> None:
    """Issue 22: which upstream artifacts and drafter models enter the evaluate id comes from the method
    registry (each inputs family's STAGES and MODEL), not from lists of names in the DAG."""
    spec = METHODS[method]
    step = plan(small_cfg(tmp_path, f"evaluate.methods=[{method}]"), ["evaluate"])["evaluate"]
    assert set(step.inputs) == {"count", *spec.stages}
    assert set(step.config.get("models", {})) == ({spec.model} if spec.model else set())
    without_other = small_cfg(tmp_path, f"evaluate.methods=[{method}]", "evaluate.drafter_other=null",
                              "evaluate.drafter_bytes=null")
    # a null drafter_other / drafter_bytes skips the methods that draft with it: no model, no fingerprint
    models = plan(without_other, ["evaluate"])["evaluate"].config.get("models", {})
    assert set(models) == ({spec.model} if spec.model == "drafter" else set())


def test_generate_tokenises_with_the_configured_tokenizer(tmp_path: Path, tiny_kit) -> None:
    """A separate ``target.tokenizer`` (here the target's own vocabulary with another chat template)
    is what generate's prompts are rendered with, as the fingerprint and the model load already use."""
    from pipeline.models.loading import load_tokenizer
    from pipeline.models.target import Target

    own = load_tokenizer("tiny:test/target")
    custom = load_tokenizer("tiny:test/target")
    custom.chat_template = "custom-system-line\n" + own.chat_template
    custom.save_pretrained(tmp_path / "tokenizer")
    cfg = small_cfg(tmp_path, f"target.tokenizer={tmp_path / 'tokenizer'}", "generate.kind=raw",
                    "generate.limit=4", "generate.max_new_tokens=64")
    assert Target(cfg.target).tokenizer().chat_template == custom.chat_template
    art = generate.main(cfg)
    marker = custom("custom-system-line\n", add_special_tokens=False)["input_ids"]
    rows = list(iter_rows(art.path / "data"))
    assert rows and all(row["input_ids"][: len(marker)] == marker for row in rows)
    assert Target(cfg.target).fingerprint["vocab_hash"] == art.fingerprint["vocab_hash"]


def test_drafter_plan_prints_ids_and_cache_status(tmp_path: Path, tiny_kit, capsys) -> None:
    args = ["plan", "--json", f"workdir={tmp_path}", *SMALL]
    assert cli_main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    default = default_stages(load_config(None, [f"workdir={tmp_path}", *SMALL]))  # train_dflash is opt-in
    assert [(r["stage"], r["status"]) for r in rows] == [("tiny kit", "cached")] + [(s, "to run") for s in default]
    generate.main(load_config(None, [f"workdir={tmp_path}", *SMALL]))
    capsys.readouterr()  # Lightning's own console output
    assert cli_main(args) == 0
    status = {r["stage"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert status == {"tiny kit": "cached", "generate": "cached", "count": "to run", "train_drafter": "to run", "cluster": "to run",
                      "train_router": "to run", "estimate_rdk": "to run", "evaluate": "to run"}
    assert cli_main(["plan", f"workdir={tmp_path}", *SMALL]) == 0
    table = capsys.readouterr().out
    assert "generate-" in table and "cached" in table and "6 stage(s) to run" in table


def test_plan_and_status_build_no_kit_and_name_it_as_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fresh machine `drafter plan` and `drafter status` answer from the recipe: no kit is trained
    (it took 12 min before they printed), and the kit the config names shows as a row to build."""
    from pipeline.orchestration import slurm
    from pipeline.tiny import kit_hash

    cache = tmp_path / "empty-cache"
    monkeypatch.setenv("DRAFTER_CACHE", str(cache))
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"workdir={tmp_path / 'work'}"])
    the_plan = plan(cfg)
    assert [k.row()["status"] for k in the_plan.kits] == ["to build"]
    assert the_plan.kits[0].row()["artifact_id"] == f"default-{kit_hash('default')}"
    assert set(the_plan.stages) == set(default_stages(cfg))
    rows = slurm.status(cfg, list(STAGE_NAMES))
    assert [r.stage for r in rows] == list(STAGE_NAMES) and not any(r.artifact for r in rows)
    assert all(r.why == "not submitted (drafter submit); provisional id until the tiny kit is built (drafter tiny)"
               for r in rows), [r.why for r in rows]
    assert not cache.exists() or not any(cache.rglob("*.safetensors")), "planning must not build the kit"
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "plan", "--config", str(ROOT / "configs" / "tiny.yaml"),
                          f"workdir={tmp_path / 'work'}"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "DRAFTER_CACHE": str(cache)}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"default-{kit_hash('default')}" in out.stdout and "to build" in out.stdout
    assert "The ids are provisional until the tiny kit is built" in out.stdout
    assert not any(cache.rglob("*.safetensors"))
    # submitting would record jobs under ids the jobs will not publish (they build the kit, then plan again)
    with pytest.raises(DrafterError, match="tiny kit this config names is not built") as err:
        slurm.submit(cfg, ["generate"], [])
    assert "drafter tiny --profile default" in err.value.fix
    assert not any(cache.rglob("*.safetensors"))


def test_ids_planned_before_the_kit_is_built_are_provisional(tmp_path: Path, tiny_kit) -> None:
    """Before the kit is built an id holds the recipe alone and the plan says so; once built, every id also names
    the files the kit was built into (they differ from machine to machine), so the ids change."""
    import shutil

    cfg = small_cfg(tmp_path)
    built = plan(cfg)
    assert [k.built for k in built.kits] == [True] and not built.provisional
    assert built.stages["generate"].fingerprint["weights"].startswith("kit:")
    empty = tmp_path / "no-kit"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTER_CACHE", str(empty))
        unbuilt = plan(cfg)
    assert [k.built for k in unbuilt.kits] == [False] and unbuilt.provisional
    assert "weights" not in unbuilt.stages["generate"].fingerprint
    assert all(unbuilt.stages[n].id != built.stages[n].id for n in built.stages)
    shutil.rmtree(empty, ignore_errors=True)


def test_run_on_a_fresh_cache_builds_the_kit_then_finds_what_that_kit_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`drafter run` plans with provisional ids, builds the kit, and plans again: a kit built into the same files
    (same machine, same recipe) finds the artifacts the first one published. Both kits are real builds of the test
    kit at a twentieth of its data and steps (tests.helpers.small_kit_profile, ~10 s each)."""
    import jobs
    from pipeline.tiny import PROFILES
    from tests.helpers import small_kit_profile

    monkeypatch.setitem(PROFILES, "determinism", small_kit_profile())
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", *(key.replace("tiny:test/", "tiny:determinism/")
                                                               for key in SMALL)])
    monkeypatch.setenv("DRAFTER_CACHE", str(tmp_path / "first"))
    first = jobs.run(cfg, ["generate"])["generate"]
    monkeypatch.setenv("DRAFTER_CACHE", str(tmp_path / "fresh"))
    assert plan(cfg).provisional
    again = jobs.run(cfg, ["generate"])["generate"]
    kit = next((tmp_path / "first" / "tiny").glob("determinism-*")).name  # the fresh cache built the same kit
    assert (tmp_path / "fresh" / "tiny" / kit / "report.json").is_file()
    assert not plan(cfg).provisional and again.id == first.id and again.path == first.path


def test_a_launch_runs_at_most_one_stage_on_several_ranks(tmp_path: Path) -> None:
    """The other ranks end with the first stage they share (rank 0 publishes): rank 0 went on alone and the next
    multi-rank stage failed "lost its peers", or hung until the collective timeout. Refused before any work."""
    two = ["generate.devices=2", "estimate_rdk.accelerator=cpu", "estimate_rdk.devices=2"]
    cfg = small_cfg(tmp_path, *two)
    alone = Launch.from_environ({})
    with pytest.raises(DrafterError, match=r"generate, estimate_rdk of them on several ranks(.*\n)*.*--stages count"):
        run(cfg, ["estimate_rdk"], alone)
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").iterdir())
    check_one_multi_rank_stage(cfg, ["generate", "count"], alone)  # one on several ranks, then one process
    check_one_multi_rank_stage(small_cfg(tmp_path), ["generate", "count", "estimate_rdk"], alone)  # all on one
    srun = Launch.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})  # every rank starts every stage
    check_one_multi_rank_stage(small_cfg(tmp_path), ["generate", "count"], srun)
    for needed in (["count", "estimate_rdk"], ["generate", "train_drafter"]):
        with pytest.raises(DrafterError, match="at most one stage on several ranks per launch"):
            check_one_multi_rank_stage(small_cfg(tmp_path), needed, srun)
    check_one_multi_rank_stage(cfg, ["generate", "count", "estimate_rdk"], Launch.from_environ({"LOCAL_RANK": "1"}))


def test_the_built_in_defaults_plan_where_no_config_file_is_at_hand(tmp_path: Path, monkeypatch, capsys) -> None:
    """``drafter plan`` (or ``run``) started outside the repository has no ``configs/tiny.yaml`` and plans the built-in
    defaults, "the same tiny setup". They named a ``top_k_128`` shortlist count's defaults did not build, so every
    command refused them ("evaluate.shortlists names shortlists count will not build")."""
    monkeypatch.chdir(tmp_path)
    assert cli_main(["plan", f"workdir={tmp_path / 'work'}"]) == 0, capsys.readouterr().err
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}"])
    assert set(cfg.evaluate.shortlists) | {cfg.evaluate.dynaspec_match} <= set(cfg.count.shortlist_names())
