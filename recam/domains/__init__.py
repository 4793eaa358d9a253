"""Domains: what a sample is, its data, model and rewards (recam.engine.domain.Domain). Importing this package
registers the built-in ones."""

from recam.domains import camera, toy  # noqa: F401
from recam.domains.motion import domain as motion  # noqa: F401  (its submodules stay importable on their own)
