"""Names in the records of metrics.jsonl that more than one reader needs (the trainer writes them; health rules,
the verifier and the epoch line read them). Plain data, no imports, so the independent verifier can share it;
recam.infra.runlog.reward_terms reads a record's reward terms with it."""

# Epoch-record keys that start with "reward_" but are not the mean of one reward: bookkeeping of the scoring.
REWARD_BOOKKEEPING = frozenset({"reward_seconds", "reward_shapes", "reward_std_mean"})
