"""Tests of the speculative-decoding engine."""
