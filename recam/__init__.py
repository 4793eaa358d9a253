"""recam: GRPO post-training for diffusion and flow-matching generators."""
