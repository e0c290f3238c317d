"""Where every input tensor went: the manifest's ``accounting`` (torch-free).

Every tensor stored in every input checkpoint (base, donors, language base, experts, a
LoRA adapter's A and B matrices) gets exactly one disposition: ``merged`` into output
tensors (with others), ``copied`` to them (their only input), ``folded`` (a LoRA A or B
matrix, added into the tensor it adapts) or ``left_out`` by the recipe with a reason.
The accounting is computed from the plan and the checkpoints' headers alone, before any
tensor data is read; a merge whose plan leaves a tensor without a disposition, or gives
it two, fails with ``tensor_unaccounted`` before anything is written, so no tensor can
vanish from an output unnoticed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from maec_core.errors import TensorUnaccounted
from maec_core.io.folder import ModelFolder
from maec_core.io.headers import TensorInfo

__all__ = ["Accounting", "InputAccount", "Uses", "account", "stored_names"]

Use = Literal["merged", "copied", "folded"]
# One output tensor and the stored tensors it is made from: (input key, tensor).
Uses = tuple[str, Sequence[tuple[str, TensorInfo]]]
# Tensors named in an error message per input; ``details`` lists them all.
_SHOWN = 8
TIED_LM_HEAD = "tied embedding: the output's lm_head shares embed_tokens"
INV_FREQ = "rotary inv_freq buffer: recomputed from the config when the model loads"


@dataclass(frozen=True)
class InputAccount:
    """One input checkpoint's tensors by disposition.

    ``tensors`` counts the tensors its files store; ``merged + copied + folded +
    left_out`` equals it. ``merged_into`` / ``copied_to`` / ``folded_into`` map each
    output tensor to the input tensors (sorted names) that went into it that way;
    ``left_out_because`` maps each reason to the input tensors (sorted) it leaves out.
    A tensor used by several output tensors (a tied embedding, a layer a slices recipe
    repeats) is listed under each; it counts once, as ``merged`` when any of them merges
    it.
    """

    tensors: int
    merged: int
    copied: int
    folded: int
    left_out: int
    merged_into: dict[str, list[str]]
    copied_to: dict[str, list[str]]
    folded_into: dict[str, list[str]]
    left_out_because: dict[str, list[str]]


@dataclass(frozen=True)
class Accounting:
    """Per input key (as the manifest's ``inputs`` names them), its account."""

    inputs: dict[str, InputAccount]

    def to_json(self) -> dict[str, Any]:
        return {key: asdict(acc) for key, acc in sorted(self.inputs.items())}


def stored_names(folder: ModelFolder) -> set[str]:
    """Every tensor stored in ``folder``'s files: for a LoRA adapter its base's and its
    own A and B matrices (the tensors the merge reads from, not the view it adapts)."""
    return {name for header in folder.headers for name in header.tensors}


def account(
    models: Mapping[str, ModelFolder],
    outputs: Iterable[Uses],
    left_out: Mapping[str, Mapping[str, str]],
    added: Collection[str] = (),
) -> Accounting:
    """The accounting of a merge of ``models`` (input key -> folder) that makes each of
    ``outputs`` (output tensor, the stored tensors it is made from) and leaves out what
    ``left_out`` names (input key -> tensor -> reason). ``added``: output tensors that
    also take values from outside the inputs (MAEC's stored ability vectors).

    A stored tensor read with a LoRA delta brings the delta's A and B along, ``folded``
    into the output. An output made from more than one stored tensor (counting A and B),
    or one of ``added``, merges them; made from one, copies it. TensorUnaccounted when a
    stored tensor of an input is neither used nor left out, or is both.
    """
    uses: dict[str, dict[str, dict[str, Use]]] = {k: {} for k in models}
    for out, made_of in outputs:
        parts = sum(1 + (2 if info.delta is not None else 0) for _, info in made_of)
        kind: Use = "merged" if parts > 1 or out in added else "copied"
        for key, info in made_of:
            mine = uses.setdefault(key, {})
            _use(mine, info.name, out, kind)
            if info.delta is not None:
                _use(mine, info.delta.a.name, out, "folded")
                _use(mine, info.delta.b.name, out, "folded")
    reasons = {k: _reasons(models[k], left_out.get(k, {})) for k in models}
    missing: dict[str, list[str]] = {}
    twice: dict[str, list[str]] = {}
    unknown: dict[str, list[str]] = {}
    accounts: dict[str, InputAccount] = {}
    for key, folder in models.items():
        stored = stored_names(folder)
        used, why = uses.get(key, {}), reasons[key]
        if gone := sorted(stored - used.keys() - why.keys()):
            missing[key] = gone
        if both := sorted(used.keys() & why.keys()):
            twice[key] = both
        if stray := sorted((used.keys() | why.keys()) - stored):
            unknown[key] = stray
        accounts[key] = _input_account(len(stored), used, why)
    if stray_keys := sorted(set(uses) - set(models)):
        unknown.update({k: sorted(uses[k]) for k in stray_keys})
    if missing or twice or unknown:
        raise _unaccounted(missing, twice, unknown)
    return Accounting(accounts)


def _use(mine: dict[str, dict[str, Use]], name: str, out: str, kind: Use) -> None:
    mine.setdefault(name, {})[out] = kind


def _reasons(folder: ModelFolder, left_out: Mapping[str, str]) -> dict[str, str]:
    """``left_out`` plus, for each left-out tensor an adapter adapts, its A and B."""
    out = dict(left_out)
    for name, reason in left_out.items():
        info = folder.tensors.get(name)
        if info is not None and info.delta is not None:
            for part in (info.delta.a, info.delta.b):
                out[part.name] = f"LoRA matrix of {name}, which is left out: {reason}"
    return out


def _input_account(stored: int, used: Mapping[str, Mapping[str, Use]],
                   why: Mapping[str, str]) -> InputAccount:
    groups: dict[Use, dict[str, list[str]]] = {"merged": {}, "copied": {}, "folded": {}}
    counts = {"merged": 0, "copied": 0, "folded": 0}
    for name, outs in used.items():
        kinds = set(outs.values())
        counts["folded" if "folded" in kinds else "merged" if "merged" in kinds
               else "copied"] += 1
        for out, kind in outs.items():
            groups[kind].setdefault(out, []).append(name)
    because: dict[str, list[str]] = {}
    for name, reason in why.items():
        because.setdefault(reason, []).append(name)

    def ordered(d: dict[str, list[str]]) -> dict[str, list[str]]:
        return {k: sorted(v) for k, v in sorted(d.items())}

    return InputAccount(
        tensors=stored, merged=counts["merged"], copied=counts["copied"],
        folded=counts["folded"], left_out=len(why),
        merged_into=ordered(groups["merged"]), copied_to=ordered(groups["copied"]),
        folded_into=ordered(groups["folded"]), left_out_because=ordered(because))


def _unaccounted(missing: Mapping[str, list[str]], twice: Mapping[str, list[str]],
                 unknown: Mapping[str, list[str]]) -> TensorUnaccounted:
    def said(what: str, found: Mapping[str, list[str]]) -> list[str]:
        return [f"{what} in {key}: {', '.join(names[:_SHOWN])}"
                + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
                for key, names in sorted(found.items())]

    parts = (said("neither used nor left out by the recipe", missing)
             + said("both used and left out", twice)
             + said("accounted for but not stored", unknown))
    return TensorUnaccounted(
        "the merge plan does not account for every input tensor; nothing was written ("
        + "; ".join(parts) + ")",
        tensors={k: list(v) for k, v in sorted(missing.items())},
        twice={k: list(v) for k, v in sorted(twice.items())},
        unknown={k: list(v) for k, v in sorted(unknown.items())})
