"""The report's wall-clock table across devices (issue 23, part 3): an evaluation finds the same config's
evaluation on another device in the store and shows both devices' tokens/s and speedups side by side. And what a
resumed evaluation keeps of its staged pieces (only those decoded on this kind of device) and warms up."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from jobs.evaluate import other_devices
from pipeline.artifacts import ArtifactWriter
from pipeline.evaluation.report import write_report
from pipeline.orchestration.dag import plan, spec
from pipeline.staged import staged_about, write_staged_json
from tests.helpers import (
    TIMED_ROW_FIELDS,
    compiled_shapes,
    kit_evaluator,
    small_cfg,
    synthetic_results,
    typed_results,
)


def _store_evaluation(cfg, device_name: str, speedup: float) -> str:
    """An evaluation artifact of ``cfg`` in its store whose report says it ran on ``device_name``."""
    step = plan(cfg, ["evaluate"])["evaluate"]
    data = synthetic_results()
    data["device"], data["decode_path"] = device_name, "graphs"
    for row in data["rows"]:
        row["speedup"] = speedup
    writer = ArtifactWriter(step.path.parent, step.id, kind=spec("evaluate").kind, stage="evaluate",
                            config=step.config, inputs=[aid for aid, _ in step.inputs.values()],
                            fingerprint=step.fingerprint)
    (writer.tmp / "report.json").write_text(json.dumps(data))
    writer.commit()
    return step.id


def test_an_evaluation_lists_the_same_config_on_another_device(tmp_path: Path, tiny_kit) -> None:
    cfg = small_cfg(tmp_path, "evaluate.device=cpu")
    assert other_devices(cfg, "cpu (2 threads)") == []  # nothing else in the store
    gpu = replace(cfg, evaluate=replace(cfg.evaluate, device="cuda"))
    evaluation = _store_evaluation(gpu, "NVIDIA H100 80GB HBM3", 2.5)
    _store_evaluation(replace(cfg, evaluate=replace(cfg.evaluate, device="auto")), "cpu (1 threads)", 0.9)
    found = other_devices(cfg, "cpu (2 threads)")
    # the CPU evaluation under device=auto is the same kind of device: only the GPU's is listed
    assert [(f["device"], f["evaluation"], f["decode_path"]) for f in found] == [
        ("NVIDIA H100 80GB HBM3", evaluation, "graphs")]
    assert {row["speedup"] for row in found[0]["rows"]} == {2.5}

    results = typed_results()
    results.decode_path, results.other_devices = "eager", found
    _, html_path, md_path = write_report(results, tmp_path / "report")
    markdown, page = md_path.read_text(), html_path.read_text()
    assert "## Wall-clock on each device" in markdown and "<h2>Wall-clock on each device</h2>" in page
    device_table = markdown.split("## Wall-clock on each device")[1]
    line = next(x for x in device_table.splitlines() if x.startswith("| chat | full |"))
    assert "| NVIDIA H100 80GB HBM3 (graphs) |" in line and line.rstrip(" |").endswith("2.50×")
    assert line.startswith("| chat | full | 3 | — | 76.8 | 1.92× |")  # this device's own figures beside
    reread = json.loads((tmp_path / "report" / "report.json").read_text())
    assert reread["other_devices"][0]["evaluation"] == evaluation and reread["decode_path"] == "eager"


def test_a_report_without_another_device_has_no_device_table(tmp_path: Path) -> None:
    _, html_path, md_path = write_report(typed_results(), tmp_path)
    assert "Wall-clock on each device" not in md_path.read_text() + html_path.read_text()


def _recorded_generations(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The evaluator's generations from now on, each recorded as ``(kind, prompt, γ)`` as it runs."""
    import pipeline.evaluation.evaluator as evaluator_module

    calls: list[tuple] = []
    real_ar, real_spec = evaluator_module.generate_autoregressive, evaluator_module.generate_speculative

    def ar(model, prompt, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(("ar", prompt, 0))
        return real_ar(model, prompt, *args, **kwargs)

    def spec_(model, proposer, prompt, new, gamma, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(("spec", prompt, gamma))
        return real_spec(model, proposer, prompt, new, gamma, *args, **kwargs)

    monkeypatch.setattr(evaluator_module, "generate_autoregressive", ar)
    monkeypatch.setattr(evaluator_module, "generate_speculative", spec_)
    return calls


@pytest.mark.parametrize("path", ["static", "eager"])
def test_the_static_paths_replay_every_timed_generation_before_anything_is_timed(path: str, tiny_kit, monkeypatch,
                                                                                  tmp_path: Path) -> None:
    """On the static paths (``graphs`` compiles a CUDA graph per shape on first use) the evaluator decodes, untimed and
    before the first timed cell, every generation the timed cells will decode, in their order. The eager path decodes
    a few tokens of the first prompt autoregressively and with each configuration at each γ: it warmed up
    autoregressive decoding alone, so a configuration's one-off costs (DynaSpec's Triton kernel compiling on a GPU)
    landed in its first timed cell."""
    evaluator = kit_evaluator(tmp_path, path, "evaluate.max_new_tokens=6")
    prompts = {"chat": [[5, 6, 7], [8, 9, 10, 11], [17, 18, 19]], "code": [[12, 13], [14, 15, 16]]}
    calls = _recorded_generations(monkeypatch)
    evaluator(prompts).run()
    timed = [(kind, p, g) for task in prompts.values() for kind, g in (("ar", 0), ("spec", 2), ("spec", 3))
             for p in task]
    brief = [("ar", [5, 6, 7], 0), ("spec", [5, 6, 7], 2), ("spec", [5, 6, 7], 3)]
    assert calls == (timed + timed if path == "static" else brief + timed)


def test_a_resumed_evaluation_warms_up_and_decodes_only_the_pieces_it_lacks(tiny_kit, monkeypatch,
                                                                            tmp_path: Path) -> None:
    """Path ``static``, with a staging directory: a first run stages every piece; with one task's autoregressive runs
    and one cell's staged files deleted (as a kill would have left them undone), the rerun replays and then times
    exactly those two pieces' generations, and its rows and checks are the first run's, timings aside."""
    import dataclasses

    staging = tmp_path / "staging"
    staging.mkdir()
    evaluator = kit_evaluator(tmp_path, "static", "evaluate.max_new_tokens=6", "evaluate.sampling_check_samples=20",
                              staging=staging)
    prompts = {"chat": [[5, 6, 7], [8, 9, 10, 11]], "code": [[12, 13], [14, 15, 16]]}
    first_rows, first_checks = evaluator(prompts).run()
    for piece in ("chat-ar.json", "code-0-full-g3.json"):
        (staging / piece).unlink()
    calls = _recorded_generations(monkeypatch)
    rows, checks = evaluator(prompts).run()
    lacking = [("ar", p, 0) for p in prompts["chat"]] + [("spec", p, 3) for p in prompts["code"]]
    assert calls == lacking + lacking  # the warm-up's replay, then the timed pass: nothing else decoded
    def decoded(row: Any) -> dict:
        return {k: v for k, v in dataclasses.asdict(row).items() if k not in TIMED_ROW_FIELDS}

    assert [decoded(r) for r in rows] == [decoded(r) for r in first_rows] and checks == first_checks
    assert len(checks) == 2 * 2 + 1  # two tasks × two γ greedy checks, and the configuration's first-token check


def test_a_staged_piece_decoded_on_another_device_is_decoded_again(tiny_kit, monkeypatch, tmp_path: Path) -> None:
    """A rerun keeps only the staged pieces decoded on this kind of device: a cell timed on a GPU is no figure of a
    CPU evaluation. One cell's record relabelled as decoded on an H100 (and its τ set to 99) is decoded again, with
    a line naming the piece and both devices; its row is this device's, and the piece is staged again under it."""
    staging = tmp_path / "staging"
    staging.mkdir()
    build = kit_evaluator(tmp_path, "static", "evaluate.max_new_tokens=4", "evaluate.gammas=[2]", staging=staging)
    prompts = {"chat": [[5, 6, 7]]}
    first_rows, _ = build(prompts).run()
    piece = staging / "chat-0-full-g2.json"
    staged = json.loads(piece.read_text())
    write_staged_json(piece, {**staged, "row": {**staged["row"], "tau": 99.0}},
                      about={"device": "NVIDIA H100 80GB HBM3"})
    evaluator, said = build(prompts), []
    evaluator.log = said.append
    calls = _recorded_generations(monkeypatch)
    rows, _ = evaluator.run()
    here = evaluator.device_label
    assert f"{piece.name}: decoded on NVIDIA H100 80GB HBM3, not on this {here}: decoding it again" in said, said
    assert f"resuming an interrupted evaluation: 1 of 2 pieces kept (decoded on {here})" in said, said
    assert calls == [("spec", [5, 6, 7], 2)] * 2  # the warm-up's replay and the timed pass of that cell alone
    assert rows[1].tau == first_rows[1].tau != 99.0
    assert staged_about(piece) == {"device": here}


def test_the_timed_cells_feed_no_compiled_function_a_shape_the_warm_up_did_not(tiny_kit, monkeypatch,
                                                                              tmp_path: Path) -> None:
    """Path ``graphs`` on the CPU: the same ``torch.compile`` call with a backend that runs here (no CUDA graphs), so
    dynamo compiles each shape for real. The timed cells compile nothing: every function and shape they call was
    compiled in the warm-up (dynamo's count of compiled graphs and each compiled function's shapes stand still
    after it). Which shapes a generation feeds depends on what it accepts: its last round's drafts left (a one-,
    two- or four-token verify) and the drafter's catch-up after each round. A warm-up over one prompt per prefill
    bucket (here: the first prompt) left a two-token verify and a four-token catch-up to the timed cell, the way the
    H100 evaluation of the kit timed a one-token verify's compile inside EAGLE-3's chat cell (0.20×)."""
    from torch._dynamo.utils import counters

    import pipeline.engine.static as static_module
    from pipeline.engine.static import DecodeOptions

    monkeypatch.delitem(static_module.GRAPH_COMPILE, "mode")
    monkeypatch.setitem(static_module.GRAPH_COMPILE, "backend", "eager")
    phase = ["warm-up"]
    after_warm_up: dict = {}
    # one prefill bucket: a warm-up over one prompt per prefill bucket decoded only the first prompt
    prompts = {"chat": [[40 + 7 * i + j for j in range(5)] for i in range(12)]}
    evaluator = kit_evaluator(tmp_path, "static", "evaluate.max_new_tokens=9", "evaluate.gammas=[7]")(prompts)
    evaluator.options = DecodeOptions("graphs")  # what `evaluate.device=cuda` resolves to (refused on a CPU)
    real_warm_up = evaluator._warm_up

    def warm_up(configs) -> None:  # noqa: ANN001
        real_warm_up(configs)
        phase[0] = "timed"
        after_warm_up.update(graphs=counters["stats"]["unique_graphs"], compiled=compiled_shapes())

    monkeypatch.setattr(evaluator, "_warm_up", warm_up)
    # others: the kept sessions of earlier tests in this process
    graphs_before, others = counters["stats"]["unique_graphs"], compiled_shapes()
    evaluator.run()
    assert phase[0] == "timed" and after_warm_up["graphs"] - graphs_before >= 4  # the warm-up compiled the buckets
    whats = {c.what for c in after_warm_up["compiled"] if c not in others}
    assert whats == {"the target's forward", "a draft model's forward"}, whats
    assert counters["stats"]["unique_graphs"] == after_warm_up["graphs"]  # no timed cell compiled a graph
    assert compiled_shapes() == after_warm_up["compiled"]  # nor met a shape (or a function) the warm-up had not
