"""Lightning's DeepSpeed precision plugin with the loss divided by the accumulation count once, not twice.

In automatic optimisation Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` before the
backward pass, and its DeepSpeed plugin then calls ``engine.backward(loss)``, which divides it again by
``gradient_accumulation_steps`` (the same number: Lightning sets it from the Trainer). The gradient ZeRO clips and
steps with was the mean's over that count, so ``gradient_clipping`` acted as ``clip × accumulation``, and a job on
one node (accumulation 8) trained other weights than the same config on two (accumulation 4) under one artifact id.
This plugin asks DeepSpeed not to scale (``scale_wrt_gas=False``): the gradient is that of the global batch's mean
loss, as on the DDP and single-device paths.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision


class OnceScaledDeepSpeedPrecision(DeepSpeedPrecision):
    """:class:`DeepSpeedPrecision` whose backward leaves the (already divided) loss unscaled."""

    def backward(self, tensor: Any, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, model, optimizer, *args, scale_wrt_gas=False, **kwargs)
