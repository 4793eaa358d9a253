"""The GRPO engine: domain-agnostic sampling, scoring, advantages, losses, updates, guard."""
