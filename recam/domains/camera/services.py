"""Rewards of the camera domain that need a service or state: configured before any sampling, so a judge
that is down fails at start."""

from __future__ import annotations


def setup_reward_services(config, log):
    """Configure the UnifiedReward judge and the discriminator when they are weighted; returns the
    discriminator (trained by a hook) or None."""
    weights = {k: w for k, w in config.reward.weights.items() if w > 0}
    if "unifiedscore" in weights:
        from rewards.unified import UnifiedConfig, health_check, set_unified_config

        u = config.reward.unified
        ucfg = UnifiedConfig(base_url=u.base_url, model=u.model, api_key_env=u.api_key_env,
                             prompt_format=u.prompt_format, num_frames=u.num_frames, frame_size=u.frame_size,
                             max_concurrency=u.max_concurrency, timeout_s=u.timeout_s, max_retries=u.max_retries)
        health_check(ucfg, check_model=u.check_model)
        set_unified_config(ucfg)
        log.info(f"UnifiedReward judge at {u.base_url} is up")
    if "discriminator" in weights:
        from rewards.discriminator import Discriminator, DiscriminatorConfig, set_active_discriminator

        d = config.reward.discriminator
        disc = Discriminator(DiscriminatorConfig(lr=d.lr, temperature=d.temperature,
                                                 adaptive_temperature=d.adaptive_temperature,
                                                 reg_threshold=d.reg_threshold, reg_weight=d.reg_weight,
                                                 seed=config.seed))
        set_active_discriminator(disc)
        return disc
    return None
