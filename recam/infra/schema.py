"""Names in the records of metrics.jsonl that more than one reader needs (the trainer writes them; health rules,
the verifier and the epoch line read them). Plain data, no imports, so the independent verifier can share it;
recam.engine.records.reward_terms reads a record's reward terms with it."""

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

# What some fields of a record must hold when they are there (a record may lack them: a hand-made log, an older
# writer), in the kinds of RECORD_FIELDS plus: "number or null"; "integer list", "boolean list", "object list"; and
# "number array": a list of numbers or a list of lists of numbers ((N,) or (N, T) per sample; NaN where a reward
# failed). The trainer always writes them so; a string, a null or a dict there is damage, and the rules that read the
# field would otherwise pass over it in silence. Keys ending in "*" cover every key with that prefix.
RECORD_FIELD_KINDS = {
    "epoch": {"dataset_indices": "integer list", "advantages": "number array", "rewards/*": "number array",
              "excluded": "boolean list", "optimizer_steps": "object list", "zero_std_ratio": "number",
              "first_step_ratio_deviation": "number or null", "reward_*": "number"},
    "step": {"*": "number"},  # every metric of an optimizer step is a number
}

# The field that numbers a record of this type: within one metrics.jsonl each number appears once (a resume or a
# rollback cuts the log back before it writes again), so a repeated one means the log was copied or spliced.
RECORD_KEYS = {"step": "step", "epoch": "epoch"}

# The share of an update's squared norm that repeats between independent updates, 1 / (1 + B_simple / B)
# (recam.engine.noise_scale; the KL pull counts in it as the reward's signal does), and the name it was logged under
# before the name said so: logs written then are still read.
CONSISTENT_SHARE = "update_consistent_share"
CONSISTENT_SHARE_BEFORE = "update_signal_share"


def consistent_share_of(record: dict, epoch: bool = False):
    """An epoch record's update_consistent_share (its `_epoch` value with epoch=True), from the old name
    update_signal_share where the record predates the rename; None where neither is there."""
    suffix = "_epoch" if epoch else ""
    if CONSISTENT_SHARE + suffix in record:
        return record[CONSISTENT_SHARE + suffix]
    return record.get(CONSISTENT_SHARE_BEFORE + suffix)
