"""Names in the records of metrics.jsonl that more than one reader needs (the trainer writes them; health rules,
the verifier and the epoch line read them). Plain data, no imports, so the independent verifier can share it;
recam.infra.runlog.reward_terms reads a record's reward terms with it."""

# Epoch-record keys that start with "reward_" but are not the mean of one reward: bookkeeping of the scoring.
REWARD_BOOKKEEPING = frozenset({"reward_seconds", "reward_shapes", "reward_std_mean"})

# Record types recam.infra.runlog writes. Readers judge "step" and "epoch" records; the others are read elsewhere.
RECORD_TYPES = ("step", "epoch", "eval", "reference", "health")

# What a step or epoch record must hold to be counted as one: key -> the JSON kind of its value ("integer": an int,
# "number": an int or a float, NaN included; a bool is neither). The trainer always writes these; a record without
# one is noise or another writer's, and counting it would make a log look longer (or healthier) than it is.
RECORD_FIELDS = {
    "step": {"step": "integer", "epoch": "integer"},
    "epoch": {"epoch": "integer", "step": "integer", "reward_avg": "number"},
}
