"""The evaluate methods' names, in the registry's order: what ``evaluate.methods`` is checked against.

A leaf, so the config layer validates method names without importing the engine. Everything else about a method
(family, inputs, factory, report, gates) lives in its one registry entry, :data:`pipeline.engine.methods.METHODS`,
which checks itself against this list when it is built.
"""

METHOD_NAMES: tuple[str, ...] = ("full", "shortlist", "dynaspec", "dynaspec_pa", "pa_fr", "tli", "union", "slem",
                                 "pruned", "rdk", "rdk_taylor", "rdk_prior", "tli_rdk", "tli_rdk_taylor",
                                 "tli_rdk_prior", "slrs", "slem_bytes", "eagle3")
