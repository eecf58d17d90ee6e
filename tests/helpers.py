"""What several test modules share: the small configs of the test kit (no test module imports another).

``SMALL`` makes every stage quick on the ``test`` tiny kit; ``TRAIN`` and ``ROUTER`` add short training runs of the
EAGLE-3 head and the DynaSpec router.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config.sections import PipelineConfig, load_config

SMALL = ["target.model=tiny:test/target", "generate.limit=40", "generate.shard_size=4", "generate.batch_size=4",
         "generate.max_new_tokens=12", "generate.max_prompt_tokens=48", "generate.accelerator=cpu",
         "generate.devices=1", "count.top_k=[16,64]", "count.top_p=[0.9]", "count.min_count=[2]",
         "count.draft_vocab_size=64", "evaluate.drafter=tiny:test/drafter", "cluster.drafter=tiny:test/drafter",
         "evaluate.drafter_other=tiny:test/drafter_other", "evaluate.drafter_bytes=tiny:test/drafter_bytes",
         "mlflow.experiment=stages", "mlflow.log_artifacts=false",
         # within the test kit's 128-token context (checked at plan time): 64 + 32 + gamma 4 + 1 and 128
         "evaluate.max_prompt_tokens=64", "evaluate.max_new_tokens=32", "train_drafter.max_length=128"]


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
