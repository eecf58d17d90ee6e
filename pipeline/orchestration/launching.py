"""Which stages one launch may run: a launch runs at most one stage on several ranks (see
:func:`check_one_multi_rank_stage`)."""

from __future__ import annotations

from pipeline.config.sections import PipelineConfig
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import spec
from pipeline.orchestration.lock import Launch
from pipeline.training.strategy import device_count


def local_ranks(cfg: PipelineConfig, stage: str) -> int:
    """Processes ``stage`` starts from one launch: ``num_nodes`` × its devices (every GPU for ``auto`` on one), 1 for
    a stage that runs as one process."""
    if spec(stage).one_process:
        return 1
    section = getattr(cfg, stage)
    settings = getattr(section, "train", section)  # a trainer's ranks are its train block's
    return settings.num_nodes * device_count(settings.accelerator, settings.devices)


def check_one_multi_rank_stage(cfg: PipelineConfig, needed: list[str], launch: Launch) -> None:
    """Refuse a launch that would run more than one stage on several ranks. A rank other than the first ends with
    the first stage it takes part in (rank 0 publishes); rank 0 then went on alone, and the next stage on several
    ranks waited for peers that had left ("lost its peers", or a hang until the collective timeout). Under srun or
    torchrun every rank starts every stage, so only the first needed one may be a multi-rank stage. Decided by the
    first rank (Lightning's child ranks start the command again, with the stages before theirs already published);
    its error ends the others (srun's ``--kill-on-bad-exit``, torchrun's agent)."""
    if not launch.first_rank:
        return
    if launch.external_peers:
        several = [stage for stage in needed if not spec(stage).one_process]
        late = [stage for stage in several if stage != needed[0]]
    else:
        several = [stage for stage in needed if local_ranks(cfg, stage) > 1]
        late = several[1:]
    if late:
        raise DrafterError(
            f"This launch would run {len(needed)} stages, {', '.join(several)} of them on several ranks: the other "
            "ranks end with the first stage they share, so the next one would wait for peers that have left.",
            expected="at most one stage on several ranks per launch, and (under srun or torchrun) as the first stage "
                     "it runs",
            found=f"stages to run: {', '.join(needed)}",
            fix=f"Run the stages before {late[0]} first (`drafter run --stages {needed[needed.index(late[0]) - 1]}` "
                f"in one launch), then {late[0]} in the next; `drafter submit` runs one stage a job.")
