"""The evaluate methods' names, in the registry's order: what ``evaluate.methods`` is checked against.

A leaf, so the config layer validates method names without importing the engine. Everything else about a method
(family, inputs, factory, report, gates) lives in its one registry entry, :data:`pipeline.engine.methods.METHODS`,
which checks itself against this list when it is built.
"""

METHOD_NAMES: tuple[str, ...] = ("full", "shortlist", "dynaspec", "dynaspec_pa", "pa_fr", "tli", "union", "slem",
                                 "pruned", "rdk", "rdk_taylor", "rdk_prior", "tli_rdk", "tli_rdk_taylor",
                                 "tli_rdk_prior", "slrs", "slem_bytes", "eagle3", "dflash")

OPT_IN_METHOD_NAMES: tuple[str, ...] = ("dflash",)
"""Methods evaluated only when ``evaluate.methods`` names them (``MethodSpec.opt_in``): their upstream stage is not
part of the default run (DFlash's training would make the embedded default's ``make run`` slower)."""

DEFAULT_METHOD_NAMES: tuple[str, ...] = tuple(name for name in METHOD_NAMES if name not in OPT_IN_METHOD_NAMES)
"""The default ``evaluate.methods``. It is part of the evaluate id: it only grows by appending a method that is not
opt-in."""
