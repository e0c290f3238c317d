"""Signed webhooks: a job that names ``callback_url`` is POSTed there when it ends.

- :mod:`app.webhooks.hosts`: where a callback may go (the allow-list and the address
  checks made at submission and again before every attempt).
- :mod:`app.webhooks.signing`: the HMAC-SHA256 signature and its headers.
- :mod:`app.webhooks.delivery`: one attempt, its record on the job, and the backoff.

Deliberately empty of imports: :mod:`app.settings` validates the allow-list with
:mod:`app.webhooks.hosts`, which must not pull in the delivery code (and with it the
settings module itself).
"""
