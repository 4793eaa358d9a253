"""Domains: what a sample is, its data, model and rewards (recam.engine.domain.Domain).

Built-in domains are named here and imported only when chosen (recam.engine.domain.domain_class): the camera
domain's SfM stack and the motion domain's scipy code never load for the other. Importing a domain's module
registers it, and its rewards with it."""

BUILTIN_DOMAINS = {
    "camera": "recam.domains.camera.domain",
    "motion": "recam.domains.motion.domain",
    "toy": "recam.domains.toy.domain",
}
