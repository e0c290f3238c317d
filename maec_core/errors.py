"""Errors with stable codes.

Every failure a user can cause maps to one class here with a fixed ``code`` string; the
API returns it as ``{code, message, details}`` and a failed job stores it as
``error.code``. Codes are part of the public contract: never rename one. Which HTTP
status a code answers with is the API's business (``app.api.errors``), not the library's.
"""

from __future__ import annotations

from typing import Any


class MaecError(Exception):
    """Base of every expected failure. ``details`` must be JSON-serialisable."""

    code = "merge_error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class RecipeError(MaecError):
    """The recipe or job parameters are invalid (unknown key, method, range)."""

    code = "invalid_recipe"


class EmptySelection(RecipeError):
    """A tensor filter (an include pattern, a per-tensor condition's filter) selects no
    tensor of the checkpoints, or the selection as a whole is empty."""

    code = "empty_selection"


class UnsupportedMoe(RecipeError):
    """An MoE config whose output architecture (as mergekit-moe would choose it) is one
    this service does not build."""

    code = "unsupported_moe"


class SourceError(MaecError):
    """A checkpoint source cannot be resolved or is not allowed."""

    code = "invalid_source"


class SourceNotFound(SourceError):
    code = "source_not_found"


class SourceChanged(SourceError):
    """A source is no longer what was checked when the job was submitted: a file was
    replaced, rewritten or removed, or a path now leads out of its root through a link."""

    code = "source_changed"


class CheckpointError(MaecError):
    """A checkpoint folder is unusable."""

    code = "invalid_checkpoint"


class NamesDiffer(CheckpointError):
    """A checkpoint's tensor names are not the names of its model's weights: transformers
    converts such checkpoints as it loads them (e.g. fused mixture-of-experts weights)."""


class PickleRefused(CheckpointError):
    """A pickle checkpoint (*.bin, *.pt, ...) was offered: refused, never unpickled."""

    code = "pickle_refused"


class CorruptCheckpoint(CheckpointError):
    """A safetensors file is truncated, has a lying header, or similar."""

    code = "corrupt_checkpoint"


class UnsupportedAdapter(CheckpointError):
    """A LoRA adapter of a kind the merge cannot form (DoRA, full replaced modules, ...)."""

    code = "unsupported_adapter"


class UnsupportedDtype(CheckpointError):
    """Quantized or otherwise unsupported tensor dtypes (only fp16/bf16/fp32 merge)."""

    code = "unsupported_dtype"


class IncompatibleCheckpoints(CheckpointError):
    """The inputs do not share tensor names, shapes or dtypes (or vocab sizes)."""

    code = "incompatible_checkpoints"


class TokenizerError(CheckpointError):
    """A tokenizer.json that cannot be parsed, or a tokenizer that cannot be merged."""

    code = "invalid_tokenizer"


class NonFiniteOutput(MaecError):
    """A merged tensor contains NaN or inf: nothing is published."""

    code = "non_finite_output"


def non_finite(name: str) -> NonFiniteOutput:
    """The error of a merge whose tensor ``name`` came out with NaN or inf."""
    return NonFiniteOutput(
        f"merged tensor {name!r} contains NaN or inf; nothing was written "
        "(check the inputs and parameters)",
        tensor=name,
    )


class TensorUnaccounted(MaecError):
    """The merge would leave input tensors without a disposition (neither merged,
    copied, folded nor left out by the recipe with a reason), or give one two: nothing is
    written. ``details.tensors`` lists them per input."""

    code = "tensor_unaccounted"


class ArtifactMismatch(MaecError):
    """An ability-vector artifact does not match the checkpoints it is combined with."""

    code = "artifact_mismatch"


class CorpusError(MaecError):
    """The ability corpus is missing, empty, too large or malformed."""

    code = "invalid_corpus"


class OutputExists(MaecError):
    """The output folder already exists: merges never overwrite a published result."""

    code = "output_exists"


class Cancelled(MaecError):
    """The caller asked the merge to stop (checked between tensors)."""

    code = "cancelled"


class EvalSetError(MaecError):
    """An eval spec or eval set is malformed (the message names the file and line)."""

    code = "invalid_eval_set"


class EvalSetUnreadable(EvalSetError):
    """An eval set file is missing, not a file, not UTF-8 or cannot be read."""

    code = "eval_set_unreadable"


class LmEvalTaskUnknown(EvalSetError):
    """An lm_eval set names a task lm-evaluation-harness does not know (neither one of its
    own nor one in a configured task folder)."""

    code = "unknown_lm_eval_task"


class LmEvalFailed(MaecError):
    """lm-evaluation-harness could not run a task: not installed on the worker, its data
    not found offline, or the task itself failed."""

    code = "lm_eval_failed"


class SweepError(RecipeError):
    """A parameter sweep is malformed: unknown knob, non-numeric value, too many
    candidates, or an objective naming no eval set."""

    code = "invalid_sweep"


class NoFeasibleCandidate(MaecError):
    """Every candidate of a sweep broke its constraint: nothing is published."""

    code = "no_feasible_candidate"


class InvalidGguf(CheckpointError):
    """A GGUF file that cannot be read: not GGUF, truncated, or a header that lies about
    its tensors (no tensor data is ever trusted past the file's end)."""

    code = "invalid_gguf"


class UnsupportedGguf(CheckpointError):
    """A GGUF file whose architecture or tensor types transformers' GGUF loader cannot
    dequantize: refused from its header, before any tensor is read."""

    code = "unsupported_gguf"


class UnsupportedGgufOutput(RecipeError):
    """A GGUF output type (or a merged architecture) the GGUF writer does not produce."""

    code = "unsupported_gguf_output"


class NotSplittable(MaecError):
    """The input reads of some output shards cannot be named for this merge: it is not a
    plain tensor method's (slices, MAEC, an MoE, a LoRA export), or it merges
    vocabularies or reads an adapter, whose tensors are not read by name."""

    code = "not_splittable"


class InputRangeMissing(MaecError):
    """A merge would read bytes of an input that the worker never fetched (a part of a
    split merge, or a resumed attempt, holds its inputs only in part): refused before
    any tensor is read."""

    code = "input_range_missing"
