"""The /ui pages over the real app: login and sessions, form tokens, owner isolation,
the submit form's errors (the same as the REST route's), list, detail and downloads."""

from __future__ import annotations

import hashlib
import html
import json
import re
from typing import Any

from markupsafe import escape

from app.api.ui import sessions
from app.jobs.record import encode
from app.storage.local import LocalStorage
from tests.api.conftest import Api
from tests.stack import API_KEYS
from worker.runner import JobRunner


def _token(page: str) -> str:
    found = re.search(r'name="token" value="([^"]+)"', page)
    assert found, page[:2000]
    return found.group(1)


def _login(api: Api, key: str = "alice") -> str:
    """Log the TestClient in as ``key``; returns the session's form token."""
    api.client.cookies.clear()
    form = api.client.get("/ui/login")
    r = api.client.post("/ui/login", data={"token": _token(form.text),
                                           "api_key": API_KEYS[key]},
                        follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
    return _token(api.client.get("/ui/jobs").text)


def _recipe_yaml(api: Api) -> str:
    m = api.models
    return (f"merge_method: maec\nbase_model: {m.base}\nlanguage_base: {m.lang}\n"
            f"abilities:\n  - model: {m.donor}\nparameters:\n  key_ratio: 0.25\n")


def _submit_form(api: Api, token: str, recipe: str, name: str = "") -> Any:
    return api.client.post("/ui/jobs", data={"token": token, "recipe": recipe,
                                             "name": name}, follow_redirects=False)


def _job_id(response: Any) -> str:
    assert response.status_code == 303, response.text
    return str(response.headers["location"].rsplit("/", 1)[-1])


def _set_cookie(response: Any, name: str) -> str:
    headers = [v for k, v in response.headers.multi_items() if k == "set-cookie"]
    found = [h for h in headers if h.startswith(name + "=")]
    assert found, headers
    return str(found[0])


def test_pages_need_a_session_and_login_sets_a_strict_httponly_cookie(api: Api) -> None:
    r = api.client.get("/ui/jobs", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    form = api.client.get("/ui/login")
    assert "Content-Security-Policy" in form.headers
    login_cookie = _set_cookie(form, sessions.LOGIN_COOKIE).lower()
    assert "httponly" in login_cookie and "samesite=strict" in login_cookie
    token = _token(form.text)
    bad = api.client.post("/ui/login", data={"token": token, "api_key": "nope"},
                          follow_redirects=False)
    assert bad.status_code == 401 and "Unknown API key" in bad.text
    assert sessions.COOKIE not in api.client.cookies
    # A login form posted without its own cookie's token (a cross-site post) is refused.
    forged = api.client.post("/ui/login", data={"token": "x" * 43,
                                                "api_key": API_KEYS["alice"]},
                             follow_redirects=False)
    assert forged.status_code == 403 and sessions.COOKIE not in api.client.cookies
    ok = api.client.post("/ui/login", data={"token": _token(api.client.get("/ui/login").text),
                                            "api_key": API_KEYS["alice"]},
                         follow_redirects=False)
    assert ok.status_code == 303
    cookie = _set_cookie(ok, sessions.COOKIE)
    low = cookie.lower()
    assert "httponly" in low and "samesite=strict" in low and "path=/ui" in low
    session_id = cookie.split(";")[0].split("=", 1)[1]
    # Redis holds the key id, never the key, under the id's hash, with a TTL.
    key = sessions.session_key(session_id)
    raw: dict[bytes, bytes] = api.r.hgetall(key)  # type: ignore[assignment]
    stored = {k.decode(): v.decode() for k, v in raw.items()}
    assert stored["owner"] == "alice" and API_KEYS["alice"] not in json.dumps(stored)
    ttl: int = api.r.ttl(key)  # type: ignore[assignment]
    assert 0 < ttl <= sessions.SESSION_SECONDS
    assert not api.r.exists(f"maec:ui:session:{session_id}")
    page = api.client.get("/ui/jobs")
    assert page.status_code == 200 and 'id="owner">alice<' in page.text


def test_logout_ends_the_session_and_needs_the_token(api: Api) -> None:
    token = _login(api)
    cookie = api.client.cookies[sessions.COOKIE]
    assert api.client.post("/ui/logout", data={"token": "wrong"}).status_code == 403
    r = api.client.post("/ui/logout", data={"token": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    api.client.cookies.set(sessions.COOKIE, cookie, path="/ui")
    assert api.client.get("/ui/jobs", follow_redirects=False).status_code == 303
    assert api.r.exists(sessions.session_key(cookie)) == 0


def test_a_key_removed_from_the_configuration_ends_its_sessions(api: Api) -> None:
    _login(api)
    services = api.client.app.state.services  # type: ignore[attr-defined]
    kept = dict(services.keys)
    services.keys.clear()
    services.keys.update({d: k for d, k in kept.items() if k != "alice"})
    try:
        assert api.client.get("/ui/jobs", follow_redirects=False).status_code == 303
    finally:
        services.keys.update(kept)


def test_submit_form_shows_the_api_error_inline_and_queues_a_valid_recipe(api: Api
                                                                          ) -> None:
    token = _login(api)
    m = api.models
    bad_recipe = {"merge_method": "maec", "base_model": str(m.base),
                  "language_base": str(m.lang), "abilities": [{"model": "/etc"}]}
    rest = api.client.post("/v1/jobs", json={"recipe": bad_recipe}, headers=api.auth())
    assert rest.status_code == 422
    page = _submit_form(api, token, json.dumps(bad_recipe))  # JSON is YAML too
    assert page.status_code == 422
    assert f"<code>{rest.json()['code']}</code>" in page.text
    assert str(escape(rest.json()["message"])) in page.text
    assert "/etc" in page.text  # the recipe typed is kept in the form
    # A schema error words itself as the REST route's invalid_request does.
    long_name = "n" * 201
    rest = api.client.post("/v1/jobs", json={"recipe": bad_recipe, "name": long_name},
                           headers=api.auth())
    assert rest.status_code == 422 and rest.json()["code"] == "invalid_request"
    page = _submit_form(api, token, json.dumps(bad_recipe), name=long_name)
    assert page.status_code == 422
    assert str(escape(rest.json()["message"])) in page.text
    page = _submit_form(api, token, "merge_method: [unclosed")
    assert page.status_code == 422 and "not valid YAML" in page.text
    page = _submit_form(api, token, "- just\n- a list\n")
    assert page.status_code == 422 and "YAML mapping" in page.text
    jid = _job_id(_submit_form(api, token, _recipe_yaml(api), name="from the form"))
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["status"] == "queued" and job["name"] == "from the form"
    assert job["method"] == "maec"


def test_forms_without_the_session_token_change_nothing(api: Api) -> None:
    token = _login(api)
    before = api.client.get("/v1/jobs", headers=api.auth()).json()["jobs"]
    r = _submit_form(api, "forged", _recipe_yaml(api))
    assert r.status_code == 403 and "invalid_form_token" in r.text
    assert api.client.get("/v1/jobs", headers=api.auth()).json()["jobs"] == before
    jid = _job_id(_submit_form(api, token, _recipe_yaml(api)))
    assert api.client.post(f"/ui/jobs/{jid}/cancel", data={}).status_code == 403
    # Another session's token is no good either, even for the same key.
    first = api.client.cookies[sessions.COOKIE]
    _login(api)
    assert api.client.post(f"/ui/jobs/{jid}/cancel", data={"token": token}
                           ).status_code == 403
    api.client.cookies.clear()
    api.client.cookies.set(sessions.COOKIE, first, path="/ui")
    assert api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()["status"] == "queued"
    r = api.client.post(f"/ui/jobs/{jid}/cancel", data={"token": token},
                        follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/ui/jobs/{jid}"
    assert api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()["status"] == \
        "cancelled"
    # The cancel button is gone from an ended job's page.
    assert 'id="cancel"' not in api.client.get(f"/ui/jobs/{jid}").text


def test_another_keys_job_is_refused_everywhere(api: Api) -> None:
    bobs = str(api.submit(key="bob")["id"])
    token = _login(api, "alice")
    for path in (f"/ui/jobs/{bobs}", f"/ui/jobs/{bobs}/state",
                 f"/ui/jobs/{bobs}/files/manifest.json"):
        assert api.client.get(path).status_code == 404, path
    page = api.client.get(f"/ui/jobs/{bobs}")
    assert "job_not_found" in page.text
    assert api.client.post(f"/ui/jobs/{bobs}/cancel", data={"token": token}
                           ).status_code == 404
    assert api.client.get(f"/v1/jobs/{bobs}", headers=api.auth("bob")).json()["status"] == \
        "queued"
    assert bobs not in api.client.get("/ui/jobs").text


def test_list_filters_by_status_and_pages_with_a_cursor(api: Api) -> None:
    token = _login(api)
    ids = [_job_id(_submit_form(api, token, _recipe_yaml(api))) for _ in range(3)]
    api.client.post(f"/ui/jobs/{ids[0]}/cancel", data={"token": token})
    page = api.client.get("/ui/jobs?limit=2").text
    assert ids[2] in page and ids[1] in page and ids[0] not in page
    more = re.search(r'href="(/ui/jobs\?[^"]+)" id="next-page"', page)
    assert more
    rest = api.client.get(html.unescape(more.group(1))).text
    assert ids[0] in rest and ids[2] not in rest
    cancelled = api.client.get("/ui/jobs?status=cancelled").text
    assert ids[0] in cancelled and ids[1] not in cancelled
    assert "maec" in cancelled and str(api.models.donor.name) in cancelled
    assert api.client.get("/ui/jobs?status=bogus").status_code == 422


def test_detail_shows_result_files_and_downloads_match_their_sha256(api: Api) -> None:
    token = _login(api)
    jid = _job_id(_submit_form(api, token, _recipe_yaml(api)))
    state = api.client.get(f"/ui/jobs/{jid}/state").json()
    assert state["status"] == "queued" and state["terminal"] is False
    runner = JobRunner(api.settings, api.worker_store(),
                       LocalStorage(api.settings.storage_dir), worker="test")
    assert runner.run(jid) == "succeeded"
    assert api.client.get(f"/ui/jobs/{jid}/state").json()["terminal"] is True
    page = api.client.get(f"/ui/jobs/{jid}").text
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert 'id="files"' in page
    for f in job["result"]["files"]:
        assert f["sha256"] in page
        r = api.client.get(f"/ui/jobs/{jid}/files/{f['path']}?download=1")
        assert r.status_code == 200
        assert "attachment" in r.headers["content-disposition"]
        assert hashlib.sha256(r.content).hexdigest() == f["sha256"]
    assert "merge_method: maec" in page


def test_evaluation_sweep_and_plots_render_when_the_result_has_them(api: Api) -> None:
    token = _login(api)
    jid = _job_id(_submit_form(api, token, _recipe_yaml(api)))
    runner = JobRunner(api.settings, api.worker_store(),
                       LocalStorage(api.settings.storage_dir), worker="test")
    assert runner.run(jid) == "succeeded"
    page = api.client.get(f"/ui/jobs/{jid}").text
    assert 'id="evaluation"' not in page and 'id="sweep"' not in page
    # The sections a job with evaluate / sweep carries in its result.
    result = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()["result"]
    result["evaluation"] = {"label": "c02", "report": "eval_report.json", "table": {
        "columns": [{"name": "ppl-sw", "metric": "perplexity"}],
        "rows": [{"model": "c02", "cells": {"ppl-sw": 12.3456789}},
                 {"model": "language_base", "cells": {"ppl-sw": None}}]}}
    result["sweep"] = {"winner": "c02", "why": "lowest perplexity", "knobs": ["alpha"],
                       "rows": [{"id": "c01", "values": {"alpha": 0.5},
                                 "scores": {"ppl-sw": 14.0}, "objective": 14.0,
                                 "feasible": True, "rank": 2},
                                {"id": "c02", "values": {"alpha": 1.0},
                                 "scores": {"ppl-sw": 12.3456789}, "objective": 12.3,
                                 "feasible": True, "rank": 1}]}
    png = next(f for f in result["files"] if f["path"] == "manifest.json")
    result["files"].append({**png, "path": "sweep.png"})
    api.r.hset(f"maec:job:{jid}", mapping=encode({"result": result}))
    page = api.client.get(f"/ui/jobs/{jid}").text
    assert 'id="evaluation"' in page and "12.35" in page and "perplexity" in page
    assert 'id="sweep"' in page and 'id="winner">c02<' in page
    assert "lowest perplexity" in page and 'class="winner"' in page
    assert f'<img src="/ui/jobs/{jid}/files/sweep.png"' in page


def test_assets_are_served_from_the_service_and_pages_forbid_other_origins(api: Api
                                                                           ) -> None:
    for name, kind in (("ui.css", "text/css"), ("ui.js", "text/javascript")):
        r = api.client.get(f"/ui/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert api.client.get("/ui/static/..%2Fviews.py").status_code == 404
    assert api.client.get("/ui/static/nope.js").status_code == 404
    page = api.client.get("/ui/login")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "http" not in re.sub(r'content="[^"]*"', "", page.text.split("<body>")[0])
    assert "<script>" not in page.text


def test_what_users_typed_is_escaped_in_every_page(api: Api) -> None:
    token = _login(api)
    evil = '<img src=x onerror="alert(1)">'
    jid = _job_id(_submit_form(api, token, _recipe_yaml(api), name=evil))
    for path in (f"/ui/jobs/{jid}", "/ui/jobs"):
        page = api.client.get(path).text
        assert evil not in page and str(escape(evil)) in page, path
    page = _submit_form(api, token, f"merge_method: maec\nbase_model: '{evil}'\n")
    assert evil not in page.text and page.status_code == 422


def test_dev_mode_logs_in_as_the_dev_key(api_factory: Any) -> None:
    dev: Api = api_factory(dev_mode=True)
    form = dev.client.get("/ui/login")
    r = dev.client.post("/ui/login", data={"token": _token(form.text), "api_key": "anything"},
                        follow_redirects=False)
    assert r.status_code == 303
    assert 'id="owner">dev<' in dev.client.get("/ui/jobs").text


def test_a_form_with_too_many_fields_is_refused(api: Api) -> None:
    token = _login(api)
    body = "&".join([f"token={token}"] + [f"f{i}=x" for i in range(40)])
    r = api.client.post("/ui/jobs", content=body,
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 422 and "too many form fields" in r.text


def test_the_rest_routes_rate_limit_applies_to_pages_with_its_retry_after(
        api_factory: Any) -> None:
    limited: Api = api_factory(rate_limit_per_minute=1, rate_limit_burst=2)
    _login(limited)  # takes one token (the list page it reads for its form token)
    limited.client.get("/ui/jobs")
    r = limited.client.get("/ui/jobs")
    assert r.status_code == 429 and "rate_limited" in r.text
    assert int(r.headers["retry-after"]) >= 1


def test_wrong_keys_at_the_login_form_count_as_failed_authentications(api_factory: Any
                                                                      ) -> None:
    guarded: Api = api_factory(auth_failures_per_minute=1, auth_failure_burst=2)
    codes = []
    for key in ("guess-1", "guess-2", "guess-3", API_KEYS["alice"]):
        form = guarded.client.get("/ui/login")
        r = guarded.client.post("/ui/login", data={"token": _token(form.text),
                                                   "api_key": key}, follow_redirects=False)
        codes.append(r.status_code)
    # Once the address is over its limit, wrong keys are refused; the right key still
    # logs in (failures of others behind the same address lock nobody out).
    assert codes == [401, 401, 429, 303], codes
    assert sessions.COOKIE in guarded.client.cookies
    # The REST routes share that bucket: a failure is refused, a valid key is not.
    assert guarded.client.get("/v1/jobs", headers={"Authorization": "Bearer nope"}
                              ).status_code == 429
    assert guarded.client.get("/v1/jobs", headers=guarded.auth()).status_code == 200
