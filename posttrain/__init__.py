"""Post-training of this framework's checkpoints on the pretraining engine: supervised fine-tuning,
DPO and Self-Guided Alignment (a value head predicts per-objective scores from the prompt)."""
