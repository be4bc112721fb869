"""The OpenAI-compatible HTTP server behind `edgespec serve` (FastAPI on uvicorn)."""

from edgespec.apps.server.app import ServerSettings, create_app
from edgespec.apps.server.scheduler import Scheduler

__all__ = ["ServerSettings", "create_app", "Scheduler"]
