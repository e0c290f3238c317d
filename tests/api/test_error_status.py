"""HTTP statuses of error codes are decided in the API, not in the merge library."""

from __future__ import annotations

import inspect

import pytest

from app.api.errors import ApiError, http_status
from app.storage.base import StorageError
from maec_core import errors

LIBRARY_ERRORS = [c for _, c in inspect.getmembers(errors, inspect.isclass)
                  if issubclass(c, errors.MaecError)]
EXPECTED = {
    errors.MaecError: 400, errors.RecipeError: 422, errors.EmptySelection: 422,
    errors.SourceError: 422, errors.SourceNotFound: 422, errors.SourceChanged: 422,
    errors.CheckpointError: 422, errors.NamesDiffer: 422, errors.PickleRefused: 422,
    errors.CorruptCheckpoint: 422, errors.UnsupportedDtype: 422,
    errors.IncompatibleCheckpoints: 422, errors.NonFiniteOutput: 422,
    errors.ArtifactMismatch: 422, errors.CorpusError: 422, errors.OutputExists: 409,
    errors.Cancelled: 409, StorageError: 503,
    errors.EvalSetError: 422, errors.EvalSetUnreadable: 422, errors.TokenizerError: 422,
    errors.UnsupportedAdapter: 422, errors.SweepError: 422, errors.NoFeasibleCandidate: 422,
    errors.UnsupportedMoe: 422, errors.TensorUnaccounted: 400,
    errors.LmEvalTaskUnknown: 422, errors.LmEvalFailed: 400,
    errors.InvalidGguf: 422, errors.UnsupportedGguf: 422, errors.UnsupportedGgufOutput: 422,
    errors.NotSplittable: 400, errors.InputRangeMissing: 400,
}


@pytest.mark.parametrize("cls", LIBRARY_ERRORS, ids=lambda c: c.__name__)
def test_library_errors_carry_no_http_status(cls: type[errors.MaecError]) -> None:
    assert not hasattr(cls("x"), "http_status")


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_each_code_answers_with_its_status(cls: type[errors.MaecError]) -> None:
    assert http_status(cls("x")) == EXPECTED[cls]


def test_every_library_error_has_an_expected_status() -> None:
    assert set(LIBRARY_ERRORS) <= set(EXPECTED)


def test_a_new_subclass_answers_like_its_base_and_api_errors_keep_theirs() -> None:
    class Sliced(errors.CorruptCheckpoint):
        code = "sliced_checkpoint"

    assert http_status(Sliced("x")) == 422
    assert http_status(ApiError(429, "rate_limited", "slow down")) == 429
