"""The seed papers' analyses of trained models, each an evaluation callback (see base.Analysis)."""
