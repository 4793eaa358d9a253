"""Camera-controlled video re-rendering (ReCam): a source video re-rendered along a target camera trajectory."""

from recam.domains.camera.domain import CameraDomain  # noqa: F401
