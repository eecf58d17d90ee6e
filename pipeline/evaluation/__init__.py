"""The evaluate stage's library: the method × drafter × γ matrix, typed results and gates, the
report, and the benchmarks."""
