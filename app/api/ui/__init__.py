"""The /ui pages: job list, job detail, submit form, login (server-rendered)."""

from app.api.ui.routes import router

__all__ = ["router"]
