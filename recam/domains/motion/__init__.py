"""Human-motion diffusion (MDM family) on HumanML3D's 263 features, with a synthetic text-to-motion world."""
