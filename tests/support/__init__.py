"""Test helpers shared by both tiers: tiny models, checkpoint edits, ORT decoding and the session fixtures."""
