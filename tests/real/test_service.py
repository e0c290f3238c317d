"""A job on the real family through the service: submitted over REST, run by a real
Celery worker, downloaded, verified, loaded and asked a question."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests import real_model
from tests.conftest import StackFactory

pytestmark = pytest.mark.integration


def test_a_maec_job_on_real_weights_still_answers(make_stack: StackFactory,
                                                  family: dict[str, Path],
                                                  tmp_path: Path) -> None:
    stack = make_stack(storage="local", workers=1, local_roots=[family["base"].parent])
    job = stack.submit({"method": "maec", "base": str(family["base"]),
                        "ability_donor": [str(family["donor"])],
                        "language_base": str(family["lang"]),
                        "parameters": {"key_ratio": 0.1}, "name": "real-maec"})
    job = stack.wait(job["id"], timeout=600)
    assert job["status"] == "succeeded", job["error"]
    out = tmp_path / "downloaded"
    out.mkdir()
    with stack.client() as c:
        for f in job["result"]["files"]:
            h = hashlib.sha256()
            with c.stream("GET", f"/v1/jobs/{job['id']}/files/{f['path']}") as r, \
                    open(out / f["path"], "wb") as fh:
                assert r.status_code == 200
                for chunk in r.iter_bytes():
                    h.update(chunk)
                    fh.write(chunk)
            assert h.hexdigest() == f["sha256"], f["path"]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    model, tok = real_model.load(out)
    assert real_model.answer(model, tok, max_new_tokens=8)
    # Teacher forced: the first answer token is a near tie ("The" against "L"), the
    # token after "The capital of France is" is not.
    assert real_model.next_token(model, tok) == real_model.ANSWER
