"""Budgets of the full experiment and of the smoke run, in one place."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from experiments.transfer.model import VOCAB, ModelSize, TrainSpec

FREEZE_IO = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class BaseMix:
    """Pre-training mixture of θ0 (relative weights). T is the low-resource language: it
    gets about a quarter of S's text. No ability items (word problems) are ever in it."""

    s_text: float = 0.35
    t_text: float = 0.08
    s_gloss: float = 0.10
    t_gloss: float = 0.05
    translation: float = 0.05
    arithmetic: float = 0.35
    # T' (S relexified, the positive control): as low-resource as T, glossed like T.
    r_text: float = 0.08
    r_gloss: float = 0.05
    # Word-level code-switching was tried and did not raise the donor's T accuracy
    # (docs/experiments.md); kept as a knob, off.
    code_switch: float = 0.0


@dataclass(frozen=True)
class Sweep:
    """Grids searched on the validation split; the test split is only read at the
    chosen setting of each method."""

    key_ratio: tuple[float, ...] = (0.05, 0.2, 0.5, 1.0)
    mu: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
    selection_ratio: tuple[float, ...] = (0.5, 0.75, 1.0)
    ta_weight: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
    ties_density: tuple[float, ...] = (0.1, 0.3, 0.5)
    ties_weight: tuple[float, ...] = (1.0, 2.0)
    # Layer swapping: blocks taken from the language base at the bottom and the top (4
    # blocks in all; 2 + 2 is the language base's layers under the donor's embeddings).
    swap_bottom: tuple[int, ...] = (0, 1, 2)
    swap_top: tuple[int, ...] = (0, 1, 2)
    # MAEC variants: (importance, with θS control). The first gets the full grid above;
    # the others, to fit the time budget, the coarser grid below.
    maec_variants: tuple[tuple[str, bool], ...] = (
        ("delta", False), ("delta", True), ("gradient", False), ("gradient", True))
    coarse_mu: tuple[float, ...] = (1.0, 2.0)
    coarse_selection_ratio: tuple[float, ...] = (0.75, 1.0)
    # The grids of the added comparisons: ability B alone, both abilities in one merge
    # (per-donor weights and per-ability μ from these values), and the extended-vocabulary
    # language base. Coarser than the grids above, to keep `make experiment` in budget.
    # Weights and μ reach below 1: two full deltas on top of the language base cost more
    # fluency than one, and the constraint needs candidates that keep it.
    extra_key_ratio: tuple[float, ...] = (0.2, 0.5, 1.0)
    extra_mu: tuple[float, ...] = (0.5, 1.0, 1.5)
    extra_ta_weight: tuple[float, ...] = (0.5, 1.0, 1.5)
    extra_density: tuple[float, ...] = (0.3, 0.5)
    extra_weight: tuple[float, ...] = (0.5, 1.0)


BASE_SPEC = TrainSpec(steps=1500, lr=2e-3, warmup=100)
ABILITY_SPEC = TrainSpec(steps=400, lr=1e-3, warmup=30, freeze=FREEZE_IO, answer_only=True)
CONTROL_SPEC = TrainSpec(steps=400, lr=1e-3, warmup=30, freeze=FREEZE_IO)
LANGUAGE_SPEC = TrainSpec(steps=200, lr=5e-4, warmup=30, freeze=FREEZE_IO)
# θL′x: the language fine-tune on T′x text, which also trains the rows of T′x's new
# tokens (θ0's rows stay frozen, as in every other fine-tune).
EXT_LANGUAGE_SPEC = TrainSpec(steps=200, lr=5e-4, warmup=30, freeze=FREEZE_IO,
                              train_rows_from=len(VOCAB))
# A merge candidate is feasible when its target perplexity is at most this many times the
# language base's (the service's `constraint: {max_ratio_to: language_base}`).
PPL_RATIO = 1.5


@dataclass(frozen=True)
class Config:
    name: str
    seeds: tuple[int, ...]
    size: ModelSize = field(default_factory=ModelSize)
    seq_len: int = 48
    mix: BaseMix = field(default_factory=BaseMix)
    base: TrainSpec = BASE_SPEC
    # θA: supervised fine-tuning on S word problems (loss on the answer), layers only.
    ability: TrainSpec = ABILITY_SPEC
    # θS: the same budget on general S text (the control MAEC subtracts).
    control: TrainSpec = CONTROL_SPEC
    # θL: general T text, layers only (see docs/experiments.md for why).
    language: TrainSpec = LANGUAGE_SPEC
    # θL′x: general T′x text, layers and the new tokens' rows.
    language_ext: TrainSpec = EXT_LANGUAGE_SPEC
    n_train: int = 4000
    n_val: int = 200
    n_test: int = 400
    n_ppl_docs: int = 200
    n_align_pairs: int = 200
    # One θ0 per seed (True) or θ0 of the first seed reused by every seed (False). θ0 is
    # over half the training compute, so the 45-minute budget shares it; seeds vary the
    # problem splits, the fine-tuning data order and the fine-tunes' initial RNG.
    base_per_seed: bool = False
    # θ0's T' rows of the embedding and the LM head start as copies of their S
    # counterparts (vocabulary extension as done in practice, WECHSEL-style); without it a
    # relexified language stayed at chance for the donor (docs/experiments.md).
    aligned_init: bool = True
    sweep: Sweep = field(default_factory=Sweep)
    # One torch thread per process: on a shared 2-core machine two threads per process
    # spin against each other (a smoke θ0 made < 500 steps in 20 minutes with 2 threads,
    # 700 in 7 minutes with 1); `make experiment` runs seeds as parallel processes instead.
    threads: int = 1
    gradient_tokens: int = 16384

    def stage_key(self, stage: str, seed: int) -> str:
        """Cache key of one trained checkpoint: everything that determines its bytes."""
        parts: dict[str, object] = {"size": asdict(self.size), "seq_len": self.seq_len,
                                    "mix": asdict(self.mix), "base": self.base.as_dict(),
                                    "base_seed": seed if self.base_per_seed else self.seeds[0],
                                    "n_train": self.n_train, "code": CODE_VERSION,
                                    "aligned_init": self.aligned_init}
        if stage != "theta0":
            spec = {"thetaA": self.ability, "thetaS": self.control,
                    "thetaL": self.language, "thetaLR": self.language,
                    "thetaB": self.ability, "thetaLX": self.language_ext}[stage]
            parts.update(stage=stage, spec=spec.as_dict(), seed=seed)
        if stage in STAGE_CODE:
            # Stages added after CODE_VERSION 3 carry their own version, so changing their
            # data does not retrain θ0 and the earlier fine-tunes.
            parts["stage_code"] = STAGE_CODE[stage]
        blob = json.dumps(parts, sort_keys=True).encode()
        return f"{stage}-{hashlib.sha256(blob).hexdigest()[:12]}"

    def result_key(self, seed: int) -> str:
        """Cache key of one seed's evaluated results: the whole config and code version."""
        blob = json.dumps({"cfg": repr(self), "seed": seed, "code": CODE_VERSION,
                           "eval": EVAL_VERSION}, sort_keys=True).encode()
        return f"{self.name}-seed{seed}-{hashlib.sha256(blob).hexdigest()[:12]}"


# Bump when data generation or training code changes, so stale checkpoints are not reused.
# (Version 3's stages are unchanged by the second ability and the extended vocabulary:
# their data, vocabulary and training are byte for byte the same.)
CODE_VERSION = 3
# The same for the stages added since, one by one: θB (ability B) and θL′x (T′x).
STAGE_CODE = {"thetaB": 2, "thetaLX": 1}
# Bump when evaluation or merge code changes (invalidates cached results, not checkpoints).
EVAL_VERSION = 5

FULL = Config(name="full", seeds=(0, 1, 2))

SMOKE = Config(
    name="smoke",
    seeds=(0,),
    base=TrainSpec(steps=700, lr=2e-3, warmup=50),
    ability=TrainSpec(steps=250, lr=1e-3, warmup=20, freeze=FREEZE_IO, answer_only=True),
    control=TrainSpec(steps=250, lr=1e-3, warmup=20, freeze=FREEZE_IO),
    language=TrainSpec(steps=150, lr=5e-4, warmup=20, freeze=FREEZE_IO),
    language_ext=TrainSpec(steps=150, lr=5e-4, warmup=20, freeze=FREEZE_IO,
                           train_rows_from=len(VOCAB)),
    n_val=100,
    n_test=200,
    n_ppl_docs=100,
    n_align_pairs=100,
    sweep=Sweep(key_ratio=(0.2, 1.0), mu=(1.0, 2.0), selection_ratio=(1.0,),
                ta_weight=(0.5, 1.0), ties_density=(0.3,), ties_weight=(0.5, 1.0),
                swap_bottom=(1,), swap_top=(1,),
                maec_variants=(("delta", False),),
                extra_key_ratio=(1.0,), extra_mu=(0.5, 1.0), extra_ta_weight=(0.5, 1.0),
                extra_density=(0.3,), extra_weight=(0.5, 1.0)),
    gradient_tokens=4096,
)

# Pipeline check only (seconds): every stage and method runs, the numbers mean nothing.
DEBUG = Config(
    name="debug",
    seeds=(0, 1),
    base=TrainSpec(steps=20, lr=2e-3, warmup=5),
    ability=TrainSpec(steps=10, lr=1e-3, warmup=2, freeze=FREEZE_IO, answer_only=True),
    control=TrainSpec(steps=10, lr=1e-3, warmup=2, freeze=FREEZE_IO),
    language=TrainSpec(steps=10, lr=5e-4, warmup=2, freeze=FREEZE_IO),
    language_ext=TrainSpec(steps=10, lr=5e-4, warmup=2, freeze=FREEZE_IO,
                           train_rows_from=len(VOCAB)),
    n_train=100, n_val=20, n_test=20, n_ppl_docs=10, n_align_pairs=10,
    sweep=Sweep(key_ratio=(0.2, 1.0), mu=(1.0,), selection_ratio=(1.0,), ta_weight=(1.0,),
                ties_density=(0.3,), ties_weight=(1.0,), swap_bottom=(1,), swap_top=(1,),
                coarse_mu=(1.0,),
                coarse_selection_ratio=(1.0,),
                extra_key_ratio=(1.0,), extra_mu=(1.0,), extra_ta_weight=(1.0,),
                extra_density=(0.3,), extra_weight=(1.0,)),
    gradient_tokens=512,
)
