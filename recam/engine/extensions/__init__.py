"""Research extensions of the GRPO engine: features a run switches on by name, kept apart so that the core loop
(recam/engine/*.py) reads without them.

- variants.py: the six policy-optimisation variants, registered as the "grpo_variants" policy loss with its
  settings and the per-micro-batch inputs it needs beyond one timestep's tensors;
- fast_objectives.py: the "grpo_guard", "nft" and "awm" objectives (GRPO-Guard, DiffusionNFT, AWM);
- old_policy.py: the frozen, slowly averaged old policy that "nft" and "awm" keep;
- noise_subspace.py: exploration noise confined to a few cosine (and principal) directions
  (sample.noise_frequencies, sample.noise_channels).

Each registers itself in a core registry (policy losses, objectives) or is loaded by the core when its setting asks
for it. The core never imports this package: its registries name these modules as strings and import them when asked
what they hold, the way recam.domains names the built-in domains, so the dependency runs from here to the core only.
"""
