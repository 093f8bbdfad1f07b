"""TuneFleet's REST API (FastAPI): OpenAI-compatible files, fine-tuning jobs, models and
chat completions, scoped to the caller's tenant."""

from tunefleet.api.app import create_app, server_options

__all__ = ["create_app", "server_options"]
