"""Evaluation helpers: fidelity of sparse decoding against dense, GSM8K answer parsing."""
