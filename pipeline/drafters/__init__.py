"""Draft networks, one file per architecture, each an ``nn.Module`` that reads top to bottom.

:mod:`pipeline.drafters.eagle3` holds the EAGLE-3 draft head (fused target features, one decoder layer,
a reduced-vocabulary ``lm_head``). Objectives that train them live in :mod:`pipeline.training`; the
modules here know nothing about losses, optimizers or where they run.
"""
