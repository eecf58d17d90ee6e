"""How stages run: content-addressed artifacts, the stage DAG and its plan, one stage's life
(cache hit, build, atomic publish), and MLflow tracking."""
