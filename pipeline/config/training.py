"""The training settings every trainer reads (:class:`TrainConfig`): a leaf the config layer can import.

What a run computes (steps, batch, optimizer, schedule, evaluation) and where it runs (strategy, devices, nodes,
workers: run settings, outside every artifact id) are typed fields here; :mod:`pipeline.training` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config.schema import check_devices, check_seed, check_value, run_setting
from pipeline.errors import DrafterError


def _check(ok: bool, key: str, expected: str, found: object) -> None:
    check_value(ok, f"train.{key}", expected, found)


@dataclass
class TrainConfig:
    seed: int = 0
    """Seeds the data order (one permutation per epoch) and each micro-batch's randomness (dropout). The
    module's initial weights are the caller's."""
    max_steps: int | None = None
    """Optimizer steps to train; null: ``epochs`` passes over the training set."""
    epochs: int = 1
    """Passes over the training set when ``max_steps`` is null (each drops its last partial global batch)."""
    global_batch_size: int = 8
    """Examples per optimizer step, over all ranks and micro-batches. Fixed by the config, so devices and
    micro-batching only change how a step is computed, not what it computes (see :meth:`batch_layout`)."""
    micro_batch_size: int = run_setting(8)
    """Most examples per rank per forward/backward pass (memory, not math): each rank runs
    ``global_batch_size / ranks`` examples a step in micro-batches of this size (or fewer, see
    :meth:`batch_layout`), accumulating gradients. A run setting: the module's loss is a mean over its
    examples, so the step's gradient is the global batch's mean whatever the split."""
    lr: float = 5e-5
    """Peak learning rate of AdamW."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to every trainable parameter."""
    gradient_clipping: float = 0.5
    """Clip the global L2 norm of the gradient to this before each step; 0 turns clipping off."""
    schedule: str = "cosine"
    """``cosine``: after warmup, decay to ``min_lr_ratio x lr`` at the last step; ``constant``: stay at lr."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr/warmup_steps to lr."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine schedule, as a fraction of ``lr``."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (strategy deepspeed): 2 shards optimizer states and gradients, 1 only optimizer
    states. Stage 3 is not offered: it shards the weights the harness saves."""
    offload_optimizer: bool = False
    """DeepSpeed: keep optimizer states in CPU memory (DeepSpeed's CPU Adam, the same AdamW update)."""
    bf16: bool = True
    """DeepSpeed: bf16 weights and activations with fp32 master weights. CPU and DDP runs train in fp32 unless
    ``cpu_bf16``."""
    cpu_bf16: bool = False
    """On the CPU (single process or DDP): run forward passes under bfloat16 autocast (Lightning ``bf16-mixed``;
    weights, gradients and optimizer state stay float32). About 1.5x faster on a CPU with native bfloat16 dot
    products (AVX512-BF16, AMX); off by default because float32 keeps CPU runs exact across batch layouts."""
    strategy: str = run_setting("auto")
    """``auto`` (deepspeed with CUDA, else ddp when devices x nodes > 1, else single), ``deepspeed``,
    ``ddp`` or ``single``."""
    accelerator: str = run_setting("auto")
    """Lightning accelerator: auto, cpu or gpu."""
    devices: int | str = run_setting("auto")
    """Processes per node: auto (every GPU, or 1 on CPU), a count, or a list like "0,1"."""
    num_nodes: int = run_setting(1)
    """Nodes in the job (Slurm: $SLURM_JOB_NUM_NODES)."""
    collective_timeout: int = run_setting(1800)
    """Seconds a rank waits for its peers in one collective (the start-up rendezvous, a step's gradient
    all-reduce, a checkpoint's barrier) before it fails: a hung or dead node ends the job (Slurm's
    ``--kill-on-bad-exit`` then stops the other ranks) instead of leaving the others waiting. It must cover the
    slowest checkpoint write on the shared filesystem."""
    checkpoint_every: int = run_setting(500)
    """Write a resumable checkpoint every this many optimizer steps (and after the last one)."""
    keep_checkpoints: int = run_setting(1)
    """Completed checkpoints kept in the staging directory (older ones are deleted once a newer lands)."""
    log_every: int = run_setting(1)
    """Send metrics to MLflow every this many steps."""
    num_workers: int = run_setting(0)
    """DataLoader worker processes per rank (the order does not depend on it)."""
    progress_bar: bool = run_setting(True)
    """Draw a progress bar when stderr is a terminal (steps, rate, ETA, loss, held-out score); false, or output to
    a file: a plain line every 30 s."""
    eval_every: int | None = None
    """Call the module's ``evaluate()`` every this many steps (and after the last) and keep the weights that
    score best on its ``selection_metric`` (higher wins); null: no evaluation, the last weights are final.
    Part of the result (which weights win), so not a run setting."""

    def __post_init__(self) -> None:
        _check(self.max_steps is None or self.max_steps > 0, "max_steps", "a positive integer or null",
               self.max_steps)
        for key in ("epochs", "global_batch_size", "micro_batch_size", "checkpoint_every", "keep_checkpoints",
                    "log_every", "num_nodes", "collective_timeout"):
            _check(getattr(self, key) >= 1, key, "an integer >= 1", getattr(self, key))
        _check(self.lr > 0, "lr", "a positive number", self.lr)
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "two numbers in [0, 1)",
               self.betas)
        _check(self.eps > 0 and self.weight_decay >= 0, "eps/weight_decay", "eps > 0 and weight_decay >= 0",
               (self.eps, self.weight_decay))
        _check(self.gradient_clipping >= 0, "gradient_clipping", "a number >= 0 (0: off)", self.gradient_clipping)
        _check(self.schedule in ("cosine", "constant"), "schedule", "cosine or constant", self.schedule)
        _check(self.warmup_steps >= 0, "warmup_steps", "an integer >= 0", self.warmup_steps)
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        _check(self.zero_stage in (1, 2), "zero_stage", "1 or 2", self.zero_stage)
        _check(self.strategy in ("auto", "deepspeed", "ddp", "single"), "strategy",
               "auto, deepspeed, ddp or single", self.strategy)
        check_devices(self.accelerator, self.devices, "train")
        check_seed(self.seed, "train.seed")
        _check(self.num_workers >= 0, "num_workers", "an integer >= 0", self.num_workers)
        _check(self.eval_every is None or self.eval_every >= 1, "eval_every", "an integer >= 1 or null",
               self.eval_every)

    def batch_layout(self, world_size: int) -> tuple[int, int]:
        """``(micro-batch size, accumulation steps)`` per rank for ``world_size`` ranks.

        Each rank trains ``global_batch_size / world_size`` examples a step, in micro-batches of
        ``micro_batch_size`` (fewer when a rank's share is smaller).

        Raises:
            DrafterError: If the global batch does not split evenly over the ranks and micro-batches.
        """
        per_rank, rest = divmod(self.global_batch_size, world_size)
        micro = min(self.micro_batch_size, per_rank)
        if rest or per_rank == 0 or per_rank % micro:
            raise DrafterError(
                "train.global_batch_size does not split evenly over the ranks and micro-batches.",
                expected=f"global_batch_size ({self.global_batch_size}) = ranks ({world_size}) x micro_batch_size "
                         f"x accumulation, with micro_batch_size <= {self.micro_batch_size}",
                found=f"{self.global_batch_size} / {world_size} ranks = {self.global_batch_size / world_size:g} "
                      f"examples per rank, micro_batch_size {self.micro_batch_size}",
                fix="Pick a global_batch_size that is a multiple of ranks x micro_batch_size (or change "
                    "devices / micro_batch_size: they are run settings and do not change the result).")
        return micro, per_rank // micro
