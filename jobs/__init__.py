"""Stage recipes: one module per pipeline stage, each exposing ``main(cfg: PipelineConfig) -> Artifact``.

``STAGES`` lists them in DAG order; the ``drafter`` CLI (``jobs/cli.py``) gives each a subcommand and
``drafter run`` runs them in this order. Recipes may import ``pipeline``; ``pipeline`` never imports them.
"""

STAGES: tuple[str, ...] = ("generate", "count", "evaluate")
