"""The speculative-decoding engine: sampling, proposers (drafters), lossless verification, the decode
loops and their metrics. Cross-tokenizer proposers live in :mod:`pipeline.engine.hetero`."""

from pipeline.engine.loop import GenerationResult, generate_autoregressive, generate_speculative
from pipeline.engine.metrics import SpeculationMetrics, summarize
from pipeline.engine.proposers import FullHeadProposer, Proposal, Proposer, ShortlistProposer
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.verify import verify_exact, verify_speculative

__all__ = [
    "FullHeadProposer",
    "GenerationResult",
    "Proposal",
    "Proposer",
    "SamplingParams",
    "ShortlistProposer",
    "SpeculationMetrics",
    "generate_autoregressive",
    "generate_speculative",
    "sample",
    "standardise",
    "summarize",
    "verify_exact",
    "verify_speculative",
]
