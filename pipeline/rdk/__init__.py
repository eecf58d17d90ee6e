"""RDK (Timor et al., "Out-of-Vocabulary Sampling Boosts Speculative Decoding"): the target's next-token
moments, the token-affinity matrix built on them, and the draft transforms that redistribute a pruned or
foreign drafter's mass onto out-of-vocabulary target tokens."""
