"""Staged shards (pipeline.staged): written with a checksum, trusted on resume only if they match it."""

import os
from pathlib import Path

import pytest

from pipeline.artifacts import artifact_id
from pipeline.orchestration.stage import BuildResult
from pipeline.staged import sidecar, staged_ok, staged_problem, write_staged

FP = {"model": "tiny:test/target", "revision": "r1", "vocab_hash": "abc"}


def _write(path: Path, data: bytes) -> None:
    write_staged(path, lambda tmp: tmp.write_bytes(data))


def test_a_staged_shard_carries_its_checksum_and_a_sound_one_is_kept(tmp_path: Path) -> None:
    shard = tmp_path / "shard-00000.arrow"
    _write(shard, b"rows" * 100)
    lines: list[str] = []
    assert staged_ok(shard, lines.append) and shard.read_bytes() == b"rows" * 100 and not lines
    assert sidecar(shard).name == "shard-00000.arrow.sha256.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [shard.name, sidecar(shard).name]  # no temp file left
    assert not staged_ok(tmp_path / "shard-00001.arrow", lines.append) and not lines  # not written yet: no line


@pytest.mark.parametrize("damage, said", [
    (lambda p: p.write_bytes(p.read_bytes()[:150]), "truncated (150 of 400 bytes)"),
    (lambda p: p.write_bytes(p.read_bytes() + b"x"), "401 bytes where 400 were written"),
    (lambda p: p.write_bytes(b"R" + p.read_bytes()[1:]), "sha256 mismatch (expected "),
    (lambda p: sidecar(p).unlink(), "no checksum (shard-00003.arrow.sha256.json is missing"),
    (lambda p: sidecar(p).write_text("{"), "unreadable checksum shard-00003.arrow.sha256.json"),
])
def test_a_damaged_shard_is_deleted_with_a_line_naming_it(tmp_path: Path, damage, said: str) -> None:
    """Truncated, grown, a flipped byte, no checksum, an unreadable checksum: each is not done, is deleted with its
    checksum, and one line names the file and what was wrong."""
    shard = tmp_path / "shard-00003.arrow"
    _write(shard, b"rows" * 100)
    damage(shard)
    assert staged_problem(shard) is not None
    lines: list[str] = []
    assert not staged_ok(shard, lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"{shard.name}: {said}") and lines[0].endswith(", recomputing")
    assert not shard.exists() and not sidecar(shard).exists()
    _write(shard, b"redone")  # the redo is trusted again
    assert staged_ok(shard, lines.append) and len(lines) == 1


def test_a_write_that_fails_publishes_nothing(tmp_path: Path) -> None:
    shard = tmp_path / "sums-00000.safetensors"

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        write_staged(shard, fail)
    assert not list(tmp_path.iterdir())


def test_a_staged_shard_is_on_the_disk_before_its_name_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_staged publishes a shard by renaming its temporary file: unless the file's bytes were flushed first, a
    crash soon after could leave the shard's name (and a checksum that says it is sound) on an empty or torn file.
    The temporary file is fsynced before the rename (the real ``os.fsync``, each call's path and each rename
    recorded in order)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:  # noqa: ANN001
        events.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    shard = tmp_path / "shard-00000.arrow"
    _write(shard, b"rows" * 100)
    published = next(i for i, (kind, what) in enumerate(events) if kind == "replace" and what.endswith(f" {shard}"))
    tmp = events[published][1].split(" -> ")[0]
    assert Path(tmp).parent == tmp_path and Path(tmp).name.startswith(f".{shard.name}.tmp-"), events
    assert ("fsync", tmp) in events[:published], events


def _input(root: Path, payload: bytes):  # noqa: ANN202 - an Artifact
    """A generate artifact holding ``payload``: the same id whatever the payload (ids name what built it)."""
    from pipeline.artifacts import ArtifactStore

    config = {"generate": {"source": "rows.jsonl"}}
    aid = artifact_id("generate", config, [], FP)
    writer = ArtifactStore(root).writer(aid, kind="calibration", stage="generate", config=config, inputs=[],
                                        fingerprint=FP)
    (writer.tmp / "rows.txt").write_bytes(payload)
    return writer.commit({})


def test_staged_work_from_an_input_rebuilt_with_other_bytes_is_started_over(tmp_path: Path, capsys) -> None:
    """A stage killed with work staged (estimate_rdk's sums, a trainer's checkpoints); its input is rebuilt under the
    same id with other bytes (moved aside as damaged, or deleted, and generated again on a GPU). The rerun used to
    resume the staged work and mix the two inputs; it now starts over, saying why. The same input keeps it."""
    from pipeline.config.sections import load_config
    from pipeline.orchestration.dag import StagePlan, spec, stage_identity
    from pipeline.orchestration.stage import run_stage

    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}"])
    seen: list[list[str]] = []

    def stage(calibration, finish: bool):  # noqa: ANN001, ANN202
        def build(run):  # noqa: ANN001, ANN202
            seen.append(sorted(p.name for p in run.staging.iterdir()))
            (run.staging / f"sums-{len(seen)}.safetensors").write_bytes(calibration.file("rows.txt").read_bytes())
            if not finish:
                raise KeyboardInterrupt("killed after staging a shard")
            return BuildResult(lambda out: (out / "moments.json").write_text("{}"), {})

        row = spec("estimate_rdk")
        config = stage_identity(cfg, row)
        aid = artifact_id("estimate_rdk", config, [calibration.id], FP)
        step = StagePlan(row, aid, config, FP, inputs={"generate": (calibration.id, calibration.path)},
                         explicit=frozenset(), path=cfg.workdir_path / "artifacts" / aid)
        return run_stage(cfg, step, [calibration], build=build)

    first = _input(tmp_path / "a", b"old rows")
    with pytest.raises(KeyboardInterrupt, match="killed after staging a shard"):
        stage(first, finish=False)
    with pytest.raises(KeyboardInterrupt, match="killed after staging a shard"):
        stage(first, finish=False)  # the same input: the staged shard is kept
    assert seen[1] == ["inputs.json", "sums-1.safetensors"]
    rebuilt = _input(tmp_path / "b", b"new rows")
    assert rebuilt.id == first.id and rebuilt.manifest["files"] != first.manifest["files"]
    stage(rebuilt, finish=True)
    assert seen[2] == ["inputs.json"]  # sums-1 and sums-2 held the old rows
    assert f"the staged work was computed from other contents of {first.id} (rebuilt since): starting over" in \
        capsys.readouterr().err


def test_an_artifact_built_from_an_input_since_rebuilt_with_other_bytes_is_rebuilt(tmp_path: Path, capsys) -> None:
    """count built from a calibration set that was then rebuilt under its id with other bytes (moved aside as
    damaged, or deleted as an error advised, and generated again on a GPU): count stayed a cache hit, and a trainer
    rebuilt later read the new rows with the old rows' draft vocabulary. An artifact records its inputs' contents;
    the plan no longer calls it cached, and the run moves it to .stale/ with a line saying why and rebuilds it. The
    same input keeps it a cache hit."""
    from pipeline.config.sections import load_config
    from pipeline.orchestration.dag import StagePlan, spec, stage_identity
    from pipeline.orchestration.stage import run_stage

    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}"])
    built: list[bytes] = []

    def step_and_run(calibration):  # noqa: ANN001, ANN202
        def build(run):  # noqa: ANN001, ANN202
            rows = calibration.file("rows.txt").read_bytes()
            built.append(rows)
            return BuildResult(lambda out: (out / "counts.json").write_text(f'"{rows.decode()}"'), {})

        row = spec("count")
        config = stage_identity(cfg, row)
        aid = artifact_id("count", config, [calibration.id], FP)
        step = StagePlan(row, aid, config, FP, inputs={"generate": (calibration.id, calibration.path)},
                         explicit=frozenset(), path=cfg.workdir_path / "artifacts" / aid)
        return step, lambda: run_stage(cfg, step, [calibration], build=build)

    first = _input(tmp_path / "a", b"old rows")
    step, run = step_and_run(first)
    published = run()
    again_step, again = step_and_run(first)
    assert again_step.cached and again().id == published.id and built == [b"old rows"]  # the same input: a hit
    rebuilt = _input(tmp_path / "b", b"new rows")
    assert rebuilt.id == first.id
    step, run = step_and_run(rebuilt)
    assert not step.cached
    fresh = run()
    assert fresh.id == published.id and built == [b"old rows", b"new rows"]
    assert fresh.file("counts.json").read_text() == '"new rows"'
    err = capsys.readouterr().err
    assert f"{published.id} was built from other contents of {first.id} (rebuilt under the same id since)" in err
    assert len(list((tmp_path / "work" / "artifacts" / ".stale").iterdir())) == 1
    assert step_and_run(rebuilt)[0].cached


def test_an_artifact_that_records_no_contents_of_its_inputs_is_rebuilt(tmp_path: Path, capsys) -> None:
    """An artifact published before its inputs' contents were recorded (before 2026-11-28) cannot say whether an
    input was rebuilt under its id with other bytes since: it stayed a cache hit whatever its inputs held. The plan
    no longer calls it cached, and the run moves it to .stale/ with a line saying why and rebuilds it; the rebuilt
    one records its inputs and is a hit. An artifact without inputs has nothing to compare and stays a hit."""
    from pipeline.artifacts import ArtifactStore, input_contents, stale_inputs, unrecorded_inputs
    from pipeline.config.sections import load_config
    from pipeline.orchestration.dag import StagePlan, spec, stage_identity
    from pipeline.orchestration.stage import run_stage

    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}"])
    calibration = _input(tmp_path / "a", b"rows")
    # no inputs: nothing to record, nothing unrecorded
    assert "input_contents" not in calibration.manifest and not unrecorded_inputs(calibration.manifest)
    row = spec("count")
    config = stage_identity(cfg, row)
    aid = artifact_id("count", config, [calibration.id], FP)
    store = cfg.workdir_path / "artifacts"
    old = ArtifactStore(store).writer(aid, kind=row.kind, stage="count", config=config, inputs=[calibration.id],
                                      fingerprint=FP)  # as the code before 2026-11-28 wrote it
    (old.tmp / "counts.json").write_text('"old"')
    old = old.commit({})
    assert unrecorded_inputs(old.manifest) and stale_inputs(old.manifest, input_contents([calibration])) == [
        calibration.id]
    built: list[bytes] = []

    def build(run):  # noqa: ANN001, ANN202
        built.append(rows := calibration.file("rows.txt").read_bytes())
        return BuildResult(lambda out: (out / "counts.json").write_text(f'"{rows.decode()}"'), {})

    def step() -> StagePlan:
        return StagePlan(row, aid, config, FP, inputs={"generate": (calibration.id, calibration.path)},
                         explicit=frozenset(), path=store / aid)

    assert not step().cached
    fresh = run_stage(cfg, step(), [calibration], build=build)
    assert fresh.id == aid and built == [b"rows"] and fresh.file("counts.json").read_text() == '"rows"'
    assert fresh.manifest["input_contents"] == input_contents([calibration])
    err = capsys.readouterr().err
    assert (f"{aid} records no contents of its inputs {calibration.id} (published before 2026-11-28), so whether "
            "they were rebuilt under the same ids since cannot be checked; it will be rebuilt") in err
    assert len(list((store / ".stale").iterdir())) == 1
    assert step().cached and run_stage(cfg, step(), [calibration], build=build).id == aid and built == [b"rows"]


def test_a_one_process_stage_launched_as_several_ranks_runs_on_the_first_alone(tmp_path: Path, capsys) -> None:
    """count, cluster and evaluate run as one process. Launched as several ranks (srun of a job with more tasks),
    every rank built the stage, and evaluate's ranks each decoded on the same GPU and registered the bundle. A rank
    other than the first now stops at once: nothing built, nothing published, a line saying why."""
    from pipeline.config.sections import load_config
    from pipeline.orchestration.dag import StagePlan, spec, stage_identity
    from pipeline.orchestration.lock import Launch
    from pipeline.orchestration.stage import run_stage

    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}"])
    calibration = _input(tmp_path / "a", b"rows")
    built: list[str] = []
    row = spec("count")
    config = stage_identity(cfg, row)
    aid = artifact_id("count", config, [calibration.id], FP)
    step = StagePlan(row, aid, config, FP, inputs={"generate": (calibration.id, calibration.path)},
                     explicit=frozenset(), path=cfg.workdir_path / "artifacts" / aid)

    def build(run):  # noqa: ANN001, ANN202
        built.append(run.artifact_id)
        return BuildResult(lambda out: (out / "counts.json").write_text("{}"), {})

    second = Launch.from_environ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})
    assert run_stage(cfg, step, [calibration], build=build, launch=second) is None
    assert not built and not step.path.exists()
    assert "runs as one process: the first rank of this launch runs it, this rank stops here" in capsys.readouterr().err
    first = Launch.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert run_stage(cfg, step, [calibration], build=build, launch=first).id == aid and built == [aid]
    assert run_stage(cfg, step, [calibration], build=build, launch=second) is None  # a cache hit stops there too
