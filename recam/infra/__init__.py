"""Infrastructure: checkpoints, run logs, distributed helpers, LoRA, devices; no GRPO math."""
