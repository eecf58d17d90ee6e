"""The pipeline's stage names, in DAG order: what configs (``slurm.stages``), the CLI and the DAG table key on.

A leaf: the config layer validates stage keys against it without importing the DAG; the DAG table
(:data:`pipeline.orchestration.dag.STAGES`) is checked against it when it is built.
"""

STAGE_NAMES: tuple[str, ...] = ("generate", "count", "train_drafter", "train_dflash", "cluster", "train_router",
                                "estimate_rdk", "evaluate")
