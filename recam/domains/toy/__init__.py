"""A minimal non-video domain (2-D points, DDPM/DDIM, analytic reward) that tests train end to end in seconds."""

from recam.domains.toy.domain import ToyDomain  # noqa: F401
