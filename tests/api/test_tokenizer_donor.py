"""A tokenizer donor in a job: ``tokenizer_source`` naming a checkpoint that is not merged
(as mergekit 0.1.5 takes one) is an input of its own, pinned at submission, fetched by
the worker, named in the manifest; the output carries its vocabulary."""

from __future__ import annotations

import shutil

from tests.api.conftest import Api


def test_a_tokenizer_donor_is_fetched_and_gives_the_vocabulary(api: Api) -> None:
    from transformers import AutoTokenizer

    m = api.models
    donor = api.root / "extra" / "tokenizer-donor"
    shutil.copytree(m.lang, donor)
    tok = AutoTokenizer.from_pretrained(donor)
    tok.add_tokens(["<|donor_a|>", "<|donor_b|>"])
    tok.save_pretrained(donor)
    recipe = {"merge_method": "linear", "models": [{"model": str(m.base)},
                                                   {"model": str(m.donor)}],
              "parameters": {"weight": 0.5}, "dtype": "float32",
              "tokenizer_source": str(donor)}
    r = api.client.post("/v1/jobs", json={"recipe": recipe}, headers=api.auth())
    assert r.status_code == 202, r.text
    jid = str(r.json()["id"])
    assert any(w.startswith(f"tokenizer source {donor} is not merged")
               for w in r.json()["warnings"])
    rec = api.worker_store().get(jid)
    assert rec is not None and set(rec.sources) == {str(m.base), str(m.donor), str(donor)}
    urls, manifest = api.run_published(jid)
    assert set(manifest["inputs"]) == {str(m.base), str(m.donor), str(donor)}
    vocab = api.client.get(urls["tokenizer.json"], headers=api.auth()).json()
    added = {t["content"] for t in vocab["added_tokens"]}
    assert {"<|donor_a|>", "<|donor_b|>"} <= added
