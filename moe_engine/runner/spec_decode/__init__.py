"""Speculative decoding: draft proposers and verification."""
