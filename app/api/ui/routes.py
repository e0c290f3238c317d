"""/ui: the jobs pages for people (list, detail, submit, cancel, downloads, login).

Same keys, same owner isolation and the same submission code as the REST routes: the
handlers here call the ``/v1/jobs`` route functions with the session's caller, so a
recipe refused over REST is refused here with the same code and message. Pages are
rendered on the server; the one script (static/ui.js) only moves the progress bar.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote, urlencode

import yaml
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic import TypeAdapter, ValidationError

from app.api.deps import Services, client_address, get_services
from app.api.errors import ApiError, http_status, validation_problems
from app.api.job_body import JobBody
from app.api.limits import owner_of
from app.api.routes import files as file_routes
from app.api.routes import jobs as job_routes
from app.api.ui import sessions, views
from app.api.ui.sessions import UiSession
from app.jobs.record import STATUSES
from app.settings import DEV_OWNER
from maec_core.service import MaecError

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=str(HERE / "templates"))


def _num(value: Any) -> str:
    """A score or knob value as a table cell: 4 significant digits, '-' when absent."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int | float):
        return f"{value:.4g}"
    return str(value)


templates.env.filters["num"] = _num
router = APIRouter(prefix="/ui", include_in_schema=False)
# Every asset the pages use, read once: served from memory by name, so no request path
# ever reaches the file system.
STATIC: dict[str, tuple[bytes, str]] = {
    p.name: (p.read_bytes(), "text/css" if p.suffix == ".css" else "text/javascript")
    for p in sorted((HERE / "static").iterdir()) if p.suffix in (".css", ".js")
}
SECURITY_HEADERS = {
    # No inline script or style, nothing from another origin, no framing.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self'; connect-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_CURSOR = re.compile(r"^j_[0-9a-f]+$")
# The typed body of POST /v1/jobs: the form is checked exactly as the API checks it.
_JOB_BODY: TypeAdapter[Any] = TypeAdapter(JobBody)
PAGE_SIZE = 20
MAX_RECIPE_CHARS = 200_000
Page = Callable[[UiSession], Awaitable[Response]]


def render(request: Request, template: str, status_code: int = 200, **context: Any
           ) -> HTMLResponse:
    response = templates.TemplateResponse(request, template, context,
                                           status_code=status_code)
    response.headers.update(SECURITY_HEADERS)
    return response


def _see(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303, headers=SECURITY_HEADERS)


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form body (the only kind these pages post), last value per name."""
    raw = (await request.body()).decode("utf-8", errors="replace")
    # The pages' forms have at most four fields; more is not one of them.
    try:
        fields = parse_qs(raw, keep_blank_values=True, max_num_fields=16)
    except ValueError:
        raise ApiError(422, "invalid_request", "too many form fields") from None
    return {k: v[-1] for k, v in fields.items()}


def _error_page(request: Request, session: UiSession | None, exc: MaecError
                ) -> HTMLResponse:
    response = render(request, "error.html", http_status(exc), session=session,
                      code=exc.code, message=exc.message)
    if isinstance(exc, ApiError):  # Retry-After of a 429, for one
        response.headers.update(exc.headers)
    return response


async def _limit(request: Request, session: UiSession) -> None:
    """The limits the REST routes apply to a request (the key's bucket, and the address
    not blocked for failed logins); 429 when spent. Dev mode has none."""
    if not session.svc.settings.dev_mode:
        await session.svc.limits.request(session.owner).check()


async def _page(request: Request, handler: Page, *, limited: bool = True) -> Response:
    """Run ``handler`` for a logged-in browser; otherwise send it to the login form.
    Errors of the service become an error page with their code and message."""
    svc = await get_services(request)
    session = await sessions.current(request, svc)
    if session is None:
        return _see("/ui/login")
    try:
        if limited:
            await _limit(request, session)
        return await handler(session)
    except MaecError as exc:
        return _error_page(request, session, exc)


def _refused_form(request: Request, session: UiSession) -> HTMLResponse:
    exc = ApiError(403, "invalid_form_token", "the form expired or did not come from "
                   "this page; reload it and try again")
    return _error_page(request, session, exc)


@router.get("")
async def home() -> RedirectResponse:
    return _see("/ui/jobs")


@router.get("/static/{name}")
async def static(name: str) -> Response:
    found = STATIC.get(name)
    if found is None:
        raise ApiError(404, "not_found", f"no asset {name}")
    body, media_type = found
    return Response(body, media_type=media_type, headers={
        "Cache-Control": "public, max-age=300", "X-Content-Type-Options": "nosniff"})


@router.get("/login")
async def login_form(request: Request) -> HTMLResponse:
    return _login_page(request)


def _login_page(request: Request, error: str | None = None, status: int = 200
                ) -> HTMLResponse:
    token = secrets.token_urlsafe(32)
    response = render(request, "login.html", status, session=None, token=token,
                      error=error)
    sessions.set_cookie(response, request, sessions.LOGIN_COOKIE, token,
                        sessions.LOGIN_FORM_SECONDS)
    return response


@router.post("/login")
async def login(request: Request) -> Response:
    svc = await get_services(request)
    form = await _form(request)
    expected = request.cookies.get(sessions.LOGIN_COOKIE, "")
    if not expected or not hmac.compare_digest(
            form.get("token", "").encode(), expected.encode()):
        return _login_page(request, "The form expired; try again.", 403)
    key = form.get("api_key", "").strip()
    owner = DEV_OWNER if svc.settings.dev_mode else (owner_of(key, svc.keys) if key else None)
    try:
        if owner is None:
            # Counted like a failed REST authentication: guessing keys here is no faster.
            await svc.limits.failed_auth(client_address(request))
            return _login_page(request, "Unknown API key.", 401)
        if not svc.settings.dev_mode:  # the key's own request limit
            await svc.limits.request(owner).check()
    except ApiError as exc:
        refused = _login_page(request, exc.message, exc.http_status)
        refused.headers.update(exc.headers)
        return refused
    response = _see("/ui/jobs")
    sessions.set_cookie(response, request, sessions.COOKIE,
                        await sessions.create(svc, owner), sessions.SESSION_SECONDS)
    sessions.clear_cookie(response, sessions.LOGIN_COOKIE)
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    async def run(session: UiSession) -> Response:
        if not session.token_ok((await _form(request)).get("token")):
            return _refused_form(request, session)
        await sessions.end(request, session.svc)
        response = _see("/ui/login")
        sessions.clear_cookie(response, sessions.COOKIE)
        return response

    return await _page(request, run, limited=False)


@router.get("/jobs")
async def job_list(request: Request, status: str = "", cursor: str = "",
                   limit: Annotated[int, Query(ge=1, le=100)] = PAGE_SIZE) -> Response:
    async def run(session: UiSession) -> Response:
        if status and status not in STATUSES:
            raise ApiError(422, "invalid_request",
                           f"status must be one of {', '.join(STATUSES)}", status=status)
        if cursor and not _CURSOR.match(cursor):
            raise ApiError(422, "invalid_request", "malformed cursor")
        page = await session.svc.store.list(session.owner, status=status or None,
                                            limit=limit, cursor=cursor or None)
        more = None
        if page.next_cursor:
            more = "/ui/jobs?" + urlencode({"cursor": page.next_cursor, "limit": limit,
                                            **({"status": status} if status else {})})
        return render(request, "jobs.html", session=session, statuses=STATUSES,
                      status=status, rows=[views.row(j) for j in page.jobs], more=more,
                      first_page=not cursor)

    return await _page(request, run)


@router.get("/jobs/new")
async def new_job(request: Request) -> Response:
    async def run(session: UiSession) -> Response:
        return render(request, "submit.html", session=session, recipe="", name="",
                      error=None)

    return await _page(request, run)


def _job_body(text: str, name: str) -> dict[str, Any]:
    """The ``POST /v1/jobs`` body the form stands for (ApiError if the YAML is not a
    mapping: the REST route would never see such a recipe)."""
    if len(text) > MAX_RECIPE_CHARS:
        raise ApiError(413, "request_too_large",
                       f"recipe above {MAX_RECIPE_CHARS} characters")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ApiError(422, "invalid_request", f"the recipe is not valid YAML: {exc}"
                       ) from None
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", "the recipe must be a YAML mapping "
                       "(merge_method: ..., models: ...)")
    body: dict[str, Any] = {"recipe": data}
    if name.strip():
        body["name"] = name.strip()
    return body


async def _submit(session: UiSession, body: dict[str, Any]) -> str:
    """Validate and queue exactly as ``POST /v1/jobs`` does; returns the job id."""
    try:
        typed = _JOB_BODY.validate_python(body)
    except ValidationError as exc:
        code, message, problems = validation_problems(exc.errors())
        raise ApiError(422, code, message, problems=problems) from None
    response = await job_routes.submit(typed, session.caller)
    return str(json.loads(bytes(response.body))["id"])


@router.post("/jobs")
async def submit_job(request: Request) -> Response:
    async def run(session: UiSession) -> Response:
        form = await _form(request)
        text, name = form.get("recipe", ""), form.get("name", "")
        if not session.token_ok(form.get("token")):
            return _refused_form(request, session)
        try:
            job_id = await _submit(session, _job_body(text, name))
        except MaecError as exc:
            # Shown inline, above the recipe the user typed, with the API's code/message.
            return render(request, "submit.html", http_status(exc), session=session,
                          recipe=text, name=name,
                          error={"code": exc.code, "message": exc.message})
        return _see(f"/ui/jobs/{quote(job_id)}")

    return await _page(request, run)


@router.get("/jobs/{job_id}")
async def job_detail(request: Request, job_id: str) -> Response:
    async def run(session: UiSession) -> Response:
        rec = await session.svc.store.get_shown(job_id, session.owner)
        if rec is None:
            raise job_routes.not_found(job_id)
        return render(request, "job.html", session=session, d=views.detail(rec))

    return await _page(request, run)


@router.get("/jobs/{job_id}/state")
async def job_state(request: Request, job_id: str) -> Response:
    """The live part of the job page, polled by its script (JSON, not a page)."""
    svc: Services = await get_services(request)
    session = await sessions.current(request, svc)
    if session is None:
        raise ApiError(401, "unauthorized", "log in at /ui/login")
    await _limit(request, session)
    rec = await svc.store.get_shown(job_id, session.owner)
    if rec is None:
        raise job_routes.not_found(job_id)
    return JSONResponse(views.state(rec), headers={"Cache-Control": "no-store"})


@router.post("/jobs/{job_id}/cancel")
async def cancel(request: Request, job_id: str) -> Response:
    async def run(session: UiSession) -> Response:
        if not session.token_ok((await _form(request)).get("token")):
            return _refused_form(request, session)
        await job_routes.cancel_job(job_id, session.caller)
        return _see(f"/ui/jobs/{quote(job_id)}")

    return await _page(request, run)


@router.get("/jobs/{job_id}/files/{path:path}")
async def download(request: Request, job_id: str, path: str, download: bool = False
                   ) -> Response:
    """A published file, served by the same code as the REST route (ranges included)."""
    async def run(session: UiSession) -> Response:
        response = await file_routes.get_file(job_id, path, request, session.caller,
                                              redirect=False)
        if download:
            filename = quote(path.rsplit("/", 1)[-1])
            response.headers["Content-Disposition"] = \
                f"attachment; filename*=UTF-8''{filename}"
        elif path.lower().endswith(".png"):
            # Shown in the page (plots): an image, not a download.
            response.headers["Content-Type"] = "image/png"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    return await _page(request, run)
