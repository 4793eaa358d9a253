"""Names in the records of metrics.jsonl that more than one reader needs (the trainer writes them; health rules,
the verifier and the epoch line read them). Plain data, no imports, so the independent verifier can share it."""

# Epoch-record keys that start with "reward_" but are not the mean of one reward: bookkeeping of the scoring.
REWARD_BOOKKEEPING = frozenset({"reward_seconds", "reward_shapes", "reward_std_mean"})


def reward_terms(record: dict, include_avg: bool = False) -> dict[str, float]:
    """reward_<name> -> mean of that reward over the epoch's scored samples, for every reward that was computed
    (reward_avg, the weighted one that drives training, only with include_avg)."""
    return {k: v for k, v in record.items()
            if k.startswith("reward_") and k not in REWARD_BOOKKEEPING and isinstance(v, float)
            and (include_avg or k != "reward_avg")}
