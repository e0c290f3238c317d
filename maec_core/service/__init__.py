"""The front door of ``maec_core`` for the service: everything ``app`` and ``worker`` use.

The service imports the library only from here (the ``service-front-door`` import
contract), so the core's modules can move without the service noticing. This module is
torch-free, as the API process must be: recipes and their checks, plans, the methods'
descriptions, checkpoint folders read from their headers, and the errors.
What merges, builds or evaluates, and a run's options (torch, or code that loads it),
is :mod:`maec_core.service.running`.
"""

from __future__ import annotations

from maec_core.artifact_store import META_NAME, check_key
from maec_core.checksums import sha256_file
from maec_core.errors import (
    Cancelled,
    CorpusError,
    CorruptCheckpoint,
    EmptySelection,
    EvalSetError,
    EvalSetUnreadable,
    InputRangeMissing,
    InvalidGguf,
    MaecError,
    NotSplittable,
    RecipeError,
    SourceChanged,
    SourceError,
    SourceNotFound,
    TokenizerError,
)
from maec_core.eval.lm_eval_tasks import LmEvalConfig, check_lm_eval_sets
from maec_core.eval.report import EvalReport
from maec_core.eval.sets import SET_MAX_BYTES, load_set
from maec_core.gguf.header import (
    LOSSY_WARNING,
    GgufHeader,
    check_readable,
    find_gguf,
    is_gguf_name,
    read_header,
)
from maec_core.gguf.header import MAX_HEADER_BYTES as GGUF_MAX_HEADER_BYTES
from maec_core.gguf.output import add_gguf, gguf_copy
from maec_core.gguf.writer import check_output, check_type
from maec_core.io.adapter import ADAPTER_CONFIG
from maec_core.io.folder import (
    INDEX_FILE,
    MAX_JSON_BYTES,
    MAX_SIDE_FILE_BYTES,
    PICKLE_SUFFIXES,
    TOKENIZER_FILES,
    ModelFolder,
    open_model_folder,
)
from maec_core.io.headers import MAX_HEADER_BYTES
from maec_core.job_plan import JobPlan, Joined, plan_job, published_manifest
from maec_core.job_progress import StageSpans, candidate_at, job_spans
from maec_core.manifest import MANIFEST_NAME, FileEntry, Manifest, write_manifest
from maec_core.methods import MergeMethod, NamedForm, TensorMethod, all_methods, get_method
from maec_core.methods.base import FINITE_MAX
from maec_core.moe.config import MOE_METHOD, MoeConfig, parse_moe_config
from maec_core.moe.plan import MoePlan, plan_moe
from maec_core.parsing import parse_recipe, recipe_warnings
from maec_core.plan import MergePlan, plan_recipe
from maec_core.recipe import ModelEntry, Recipe, Slice, SliceSource
from maec_core.recipe.values import Condition, ParamValue
from maec_core.sweep.grid import Candidate, candidates
from maec_core.vocab.tokens import keep_tokenizer

__all__ = [
    "ADAPTER_CONFIG",
    "FINITE_MAX",
    "GGUF_MAX_HEADER_BYTES",
    "INDEX_FILE",
    "LOSSY_WARNING",
    "MANIFEST_NAME",
    "MAX_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "MAX_SIDE_FILE_BYTES",
    "META_NAME",
    "MOE_METHOD",
    "PICKLE_SUFFIXES",
    "SET_MAX_BYTES",
    "TOKENIZER_FILES",
    "Cancelled",
    "Candidate",
    "Condition",
    "CorpusError",
    "CorruptCheckpoint",
    "EmptySelection",
    "EvalReport",
    "EvalSetError",
    "EvalSetUnreadable",
    "FileEntry",
    "GgufHeader",
    "InputRangeMissing",
    "InvalidGguf",
    "JobPlan",
    "Joined",
    "LmEvalConfig",
    "MaecError",
    "Manifest",
    "MergeMethod",
    "MergePlan",
    "ModelEntry",
    "ModelFolder",
    "MoeConfig",
    "MoePlan",
    "NamedForm",
    "NotSplittable",
    "ParamValue",
    "Recipe",
    "RecipeError",
    "Slice",
    "SliceSource",
    "SourceChanged",
    "SourceError",
    "SourceNotFound",
    "StageSpans",
    "TensorMethod",
    "TokenizerError",
    "add_gguf",
    "all_methods",
    "candidate_at",
    "candidates",
    "check_key",
    "check_lm_eval_sets",
    "check_output",
    "check_readable",
    "check_type",
    "find_gguf",
    "get_method",
    "gguf_copy",
    "is_gguf_name",
    "job_spans",
    "keep_tokenizer",
    "load_set",
    "open_model_folder",
    "parse_moe_config",
    "parse_recipe",
    "plan_job",
    "plan_moe",
    "plan_recipe",
    "published_manifest",
    "read_header",
    "recipe_warnings",
    "sha256_file",
    "write_manifest",
]
