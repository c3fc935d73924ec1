"""The reward service: one verifier pool scoring answers for the whole mesh."""
