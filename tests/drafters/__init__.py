"""Tests of the draft networks and their training objectives."""
