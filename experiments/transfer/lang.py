"""Two synthetic languages, their shared concepts, and every text the experiment trains on.

S (the high-resource "English") is subject-verb-object with adjectives before nouns; T (the
low-resource target) is verb-object-subject (as Malagasy) with adjectives after nouns, and
every word of T differs from every word of S. Only numbers and punctuation are shared,
as real languages share numerals and punctuation.

T' (code ``R``, the positive control) is S *relexified*: S's grammar word for word, every
word replaced by a new one, numerals shared. A donor trained on S must be able to answer
T' zero-shot when the base maps T' words onto their S counterparts (the base's T' rows
start as copies of the S rows, see ``model.copy_rows``); if it cannot, the harness is
suspect.

Why VOS for T: in an arithmetic word problem the quantity must be read together with its
verb ("gets 4" vs "loses 4"). Under SOV the number comes before its verb, and under VSO
the subject separates them, so a donor trained on S would have to solve a different
routing problem in T: with VSO (tried, see docs/experiments.md) the donor was right on
S but near chance on T. VOS keeps the verb directly before its object, as SVO does, while
subject placement, question order and adjective order still differ.

Every word of either language expresses one language-neutral *concept*; concept tokens
(``@anna``, ``@get`` ...) exist only in gloss sequences of the base's pre-training, which
give the base a reason to map S and T words onto shared internal representations.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

PAD, BOS, EOS, UNK = "[PAD]", "[BOS]", "[EOS]", "[UNK]"
SPECIALS = [PAD, BOS, EOS, UNK]

# Numbers are whole tokens: small integers keep the arithmetic a table the tiny base can
# learn during pre-training, so fine-tuning only has to learn to *read* a word problem.
MAX_NUM = 15
NUMBERS = [str(i) for i in range(MAX_NUM + 1)]
# Shared symbols: punctuation, the arithmetic operators of the language-neutral number
# data, the gloss marker and the translation marker.
SYMBOLS = [".", "?", "+", "-", "=", "=>", "<tr>"]

# concept -> (S word, T word). The categories drive the grammar below.
NAMES = {
    "anna": ("anna", "miro"),
    "ben": ("ben", "taku"),
    "cara": ("cara", "lesi"),
    "dan": ("dan", "voro"),
    "eva": ("eva", "nuka"),
    "finn": ("finn", "palo"),
}
OBJECTS = {
    "apple": ("apples", "kelo"),
    "book": ("books", "dusa"),
    "coin": ("coins", "firi"),
    "cup": ("cups", "gamu"),
    "stone": ("stones", "hobe"),
    "shell": ("shells", "jiva"),
    "card": ("cards", "lomu"),
    "pen": ("pens", "zeki"),
}
VERBS = {
    "see": ("sees", "rata"),
    "like": ("likes", "soma"),
    "want": ("wants", "yeli"),
    "find": ("finds", "ponu"),
    "carry": ("carries", "wiba"),
    "paint": ("paints", "qena"),
}
# The three quantity verbs carry the ability's operations (has = state, gets = +, loses = -).
QVERBS = {
    "have": ("has", "duri"),
    "get": ("gets", "moka"),
    "lose": ("loses", "sefi"),
}
ADJS = {
    "red": ("red", "ilo"),
    "blue": ("blue", "unta"),
    "big": ("big", "gora"),
    "small": ("small", "piti"),
    "old": ("old", "vaki"),
    "new": ("new", "suno"),
}
FUNCS = {
    "the": ("the", "ka"),
    "and": ("and", "ne"),
    "is": ("is", "velu"),
    "today": ("today", "omi"),
    "not": ("not", "ru"),
    "ask": ("asks", "hiro"),
    "how": ("how", "kuma"),
    "many": ("many", "tepi"),
    "that": ("that", "bo"),
}

LEXICON: dict[str, tuple[str, str]] = {
    **NAMES, **OBJECTS, **VERBS, **QVERBS, **ADJS, **FUNCS
}
LANGS = ("S", "T")
# Languages with S's clause order (SVO, adjective before noun): S, its relexification T'
# and T'x, the same grammar again with word forms θ0's vocabulary lacks.
SVO_LANGS = ("S", "R", "X")


def _relexicon() -> dict[str, str]:
    """concept -> T' word: new CVCVC words, disjoint from S, T and each other, drawn from a
    fixed RNG so token ids are stable across runs."""
    rng = random.Random(4242)
    taken = {w for pair in LEXICON.values() for w in pair}
    out: dict[str, str] = {}
    for concept in LEXICON:
        while True:
            w = "".join(rng.choice(c) for c in ("bdgkmnprstvz", "aeiou", "lmnrstv",
                                                    "aeiou", "knrsx"))
            if w not in taken:
                taken.add(w)
                out[concept] = w
                break
    return out


RELEX: dict[str, str] = _relexicon()


def _extension_lexicon() -> dict[str, str]:
    """concept -> T'x word: the extended-vocabulary case. New 7-letter forms that no
    checkpoint but the extended language base has in its tokenizer. A merge whose
    vocabulary is a union adds them to θ0's tokenizer as *added tokens*, which are matched
    inside raw text before whitespace splitting, so no new form may occur inside another
    token (asserted here): equal-length distinct forms cannot, and every longer or equal
    existing token is checked."""
    rng = random.Random(5151)
    taken = {w for pair in LEXICON.values() for w in pair} | set(RELEX.values())
    out: dict[str, str] = {}
    for concept in LEXICON:
        while True:
            w = "".join(rng.choice(c) for c in ("fhjlwy", "aeiou", "bdgkmnprstvz", "aeiou",
                                                    "lmnrstv", "aeiou", "fhjwy"))
            if w not in taken and not any(w in t for t in taken if len(t) >= len(w)):
                taken.add(w)
                out[concept] = w
                break
    return out


RELEX_X: dict[str, str] = _extension_lexicon()
# T's clause order; "VSO" reproduces the earlier design that showed no transfer.
T_ORDER: Literal["VOS", "VSO"] = "VOS"


def word(concept: str, lang: str) -> str:
    """The surface word of a concept in one language."""
    if lang == "R":
        return RELEX[concept]
    if lang == "X":
        return RELEX_X[concept]
    return LEXICON[concept][0 if lang == "S" else 1]


_word = word


def concept_token(concept: str) -> str:
    return "@" + concept


def vocabulary() -> list[str]:
    """The whole vocabulary, in a fixed order (token ids are stable across runs)."""
    s_words = [w[0] for w in LEXICON.values()]
    t_words = [w[1] for w in LEXICON.values()]
    concepts = [concept_token(c) for c in LEXICON]
    r_words = [RELEX[c] for c in LEXICON]
    vocab = SPECIALS + NUMBERS + SYMBOLS + s_words + t_words + concepts + r_words
    assert len(vocab) == len(set(vocab)), "S, T, concept and shared tokens must be disjoint"
    return vocab


def extended_vocabulary() -> list[str]:
    """θ0's vocabulary with T'x's word forms appended (ids of every existing token kept):
    the extended language base's tokenizer."""
    vocab = vocabulary() + [RELEX_X[c] for c in LEXICON]
    assert len(vocab) == len(set(vocab))
    return vocab


# ---------------------------------------------------------------------------------------
# Sentences are built as lists of (concept-or-literal, role) "logical forms" and then
# realised in one language; the gloss of a sentence is its logical form in a fixed,
# language-neutral order, so S and T sentences with the same meaning share one gloss.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clause:
    """A language-neutral clause: verb(subject, object) with optional count/adjective."""

    verb: str
    subj: str
    obj: str | None = None
    adj: str | None = None
    count: int | None = None
    neg: bool = False
    today: bool = False

    def realise(self, lang: str, switch: Callable[[], bool] | None = None) -> list[str]:
        """S: [today] SUBJ [not] VERB the|N [ADJ] OBJ .  T: [today] VERB [not] the|N OBJ [ADJ] SUBJ.

        ``switch``, when given, is asked once per word whether to use the *other*
        language's word for it (code-switching inside this language's word order).
        """
        home = lang

        def word(concept: str, lang: str) -> str:
            other = "T" if home == "S" else "S"
            return _word(concept, other if switch is not None and switch() else home)

        w = [] if not self.today else [word("today", lang)]
        np: list[str] = []
        if self.obj is not None:
            if self.count is not None:
                np.append(str(self.count))
            else:
                np.append(word("the", lang))
            noun = word(self.obj, lang)
            if self.adj is None:
                np.append(noun)
            elif lang in SVO_LANGS:
                np += [word(self.adj, lang), noun]
            else:
                np += [noun, word(self.adj, lang)]
        neg = [word("not", lang)] if self.neg else []
        if lang in SVO_LANGS:
            w += [word(self.subj, lang), *neg, word(self.verb, lang), *np]
        elif T_ORDER == "VOS":
            w += [word(self.verb, lang), *neg, *np, word(self.subj, lang)]
        else:
            w += [word(self.verb, lang), *neg, word(self.subj, lang), *np]
        return [*w, "."]

    def gloss(self) -> list[str]:
        """Predicate-first logical form, identical for both languages."""
        g = [concept_token(self.verb)]
        if self.neg:
            g.append(concept_token("not"))
        g.append(concept_token(self.subj))
        if self.count is not None:
            g.append(str(self.count))
        if self.adj is not None:
            g.append(concept_token(self.adj))
        if self.obj is not None:
            g.append(concept_token(self.obj))
        if self.today:
            g.append(concept_token("today"))
        return g


def random_clause(rng: random.Random) -> Clause:
    """A general-text clause. Quantity verbs appear here with *random* numbers and never
    with a question or a total, so the base knows the words but not the ability."""
    subj = rng.choice(list(NAMES))
    obj = rng.choice(list(OBJECTS))
    today = rng.random() < 0.15
    if rng.random() < 0.35:
        return Clause(rng.choice(list(QVERBS)), subj, obj, count=rng.randint(0, MAX_NUM),
                      today=today)
    adj = rng.choice(list(ADJS)) if rng.random() < 0.6 else None
    return Clause(rng.choice(list(VERBS)), subj, obj, adj=adj, neg=rng.random() < 0.15,
                  today=today)


def embedded_question(rng: random.Random, lang: str) -> list[str]:
    """'ben asks how many apples anna has .' keeps the question words in general use
    (in both languages) without ever pairing a question with an answer."""
    asker, subj = rng.sample(list(NAMES), 2)
    obj = rng.choice(list(OBJECTS))
    if lang in SVO_LANGS:
        return [word(asker, lang), word("ask", lang), word("how", lang), word("many", lang),
                word(obj, lang), word(subj, lang), word("have", lang), "."]
    if T_ORDER == "VOS":
        return [word("ask", lang), word("have", lang), word("how", lang), word("many", lang),
                word(obj, lang), word(subj, lang), word(asker, lang), "."]
    return [word("ask", lang), word(asker, lang), word("how", lang), word("many", lang),
            word(obj, lang), word("have", lang), word(subj, lang), "."]


def general_sentence(rng: random.Random, lang: str) -> list[str]:
    if rng.random() < 0.1:
        return embedded_question(rng, lang)
    return random_clause(rng).realise(lang)


def general_document(rng: random.Random, lang: str, max_len: int) -> list[str]:
    """Sentences of one language packed up to max_len tokens."""
    out: list[str] = []
    while True:
        s = general_sentence(rng, lang)
        if out and len(out) + len(s) > max_len:
            return out
        out += s


def gloss_example(rng: random.Random, lang: str) -> list[str]:
    """'<sentence> => <logical form>': either language must reach the same concepts."""
    c = random_clause(rng)
    return [*c.realise(lang), "=>", *c.gloss()]


def code_switched_example(rng: random.Random, lang: str, rate: float = 0.4) -> list[str]:
    """A clause in one language's word order with words drawn from both lexicons: S and T
    words then occur in identical contexts, the distributional signal that pulls their
    representations together."""
    c = random_clause(rng)
    return c.realise(lang, switch=lambda: rng.random() < rate)


def translation_example(rng: random.Random, src: str) -> list[str]:
    """A parallel sentence pair, either direction."""
    c = random_clause(rng)
    tgt = "T" if src == "S" else "S"
    return [*c.realise(src), "<tr>", *c.realise(tgt)]


def arithmetic_example(rng: random.Random) -> list[str]:
    """Language-neutral arithmetic ('7 + 3 - 2 = 8'): the base knows how to compute, it does
    not know how to read a word problem."""
    steps = rng.randint(1, 3)
    value = rng.randint(0, MAX_NUM)
    toks = [str(value)]
    for _ in range(steps):
        value, op, n = _step(rng, value)
        toks += [op, str(n)]
    return [*toks, "=", str(value)]


def _step(rng: random.Random, value: int) -> tuple[int, str, int]:
    """One + or - step with operand 1..5 that keeps the running value in 0..MAX_NUM."""
    ops = []
    if value + 1 <= MAX_NUM:
        ops.append("+")
    if value - 1 >= 0:
        ops.append("-")
    op = rng.choice(ops)
    if op == "+":
        n = rng.randint(1, min(5, MAX_NUM - value))
        return value + n, op, n
    n = rng.randint(1, min(5, value))
    return value - n, op, n


@dataclass(frozen=True)
class Problem:
    """One ability item: a multi-step word problem with a single-token numeric answer."""

    subj: str
    obj: str
    start: int
    steps: tuple[tuple[str, int], ...]  # (qverb concept, amount)
    answer: int

    def prompt(self, lang: str) -> list[str]:
        toks = Clause("have", self.subj, self.obj, count=self.start).realise(lang)
        for verb, n in self.steps:
            toks += Clause(verb, self.subj, self.obj, count=n).realise(lang)
        if lang in SVO_LANGS:
            q = [word("how", lang), word("many", lang), word(self.obj, lang),
                 word("have", lang), word(self.subj, lang)]
        elif T_ORDER == "VOS":
            q = [word("have", lang), word("how", lang), word("many", lang),
                 word(self.obj, lang), word(self.subj, lang)]
        else:
            q = [word("have", lang), word(self.subj, lang), word("how", lang),
                 word("many", lang), word(self.obj, lang)]
        return [*toks, *q, "?"]

    def text(self, lang: str) -> list[str]:
        return [*self.prompt(lang), str(self.answer)]

    def key(self) -> tuple[object, ...]:
        return (self.subj, self.obj, self.start, self.steps)


PROBLEM_STEPS = 2


def random_problem(rng: random.Random) -> Problem:
    value = rng.randint(0, MAX_NUM)
    start = value
    steps: list[tuple[str, int]] = []
    # Two operations after the initial state: multi-step, and learnable by the donor in a
    # few hundred fine-tuning steps (three-step items held the donor near 0.7 on S).
    for _ in range(PROBLEM_STEPS):
        value, op, n = _step(rng, value)
        steps.append(("get" if op == "+" else "lose", n))
    return Problem(rng.choice(list(NAMES)), rng.choice(list(OBJECTS)), start, tuple(steps),
                   value)


class Item(Protocol):
    """An ability item: a prompt in any language and a single-token numeric answer."""

    @property
    def answer(self) -> int: ...

    def prompt(self, lang: str) -> list[str]: ...

    def text(self, lang: str) -> list[str]: ...

    def key(self) -> tuple[object, ...]: ...


@dataclass(frozen=True)
class Comparison:
    """The second ability (B): the larger or the smaller of two counts. Two people have
    some of one object; the question asks for the big or the small count::

        S:  anna has 4 apples . ben has 7 apples . how many small apples ? 4
        T:  duri 4 kelo miro . duri 7 kelo taku . kuma tepi kelo piti ? 4

    A different skill from A's running total (a comparison, no addition), with a
    single-token numeric answer, built from the fixed lexicon. Every word of the question
    occurs in θ0's general text (``how many`` in embedded questions, ``big``/``small`` as
    adjectives), but never with an answer: θ0 never sees a comparison item. The two counts
    differ, so answering one of the two numbers shown scores 0.5 by chance, and so does
    any rule that cannot read the adjective (always the larger, always the smaller): above
    0.5 in a target language, the merge reads that language's word for big or small."""

    first: str
    second: str
    obj: str
    counts: tuple[int, int]
    which: str  # concept "big" or "small"

    @property
    def answer(self) -> int:
        return max(self.counts) if self.which == "big" else min(self.counts)

    def prompt(self, lang: str) -> list[str]:
        toks: list[str] = []
        for name, n in zip((self.first, self.second), self.counts, strict=True):
            toks += Clause("have", name, self.obj, count=n).realise(lang)
        if lang in SVO_LANGS:
            q = [word("how", lang), word("many", lang), word(self.which, lang),
                 word(self.obj, lang)]
        else:
            q = [word("how", lang), word("many", lang), word(self.obj, lang),
                 word(self.which, lang)]
        return [*toks, *q, "?"]

    def text(self, lang: str) -> list[str]:
        return [*self.prompt(lang), str(self.answer)]

    def key(self) -> tuple[object, ...]:
        return (self.first, self.second, self.obj, self.counts, self.which)


def random_comparison(rng: random.Random) -> Comparison:
    first, second = rng.sample(list(NAMES), 2)
    a, b = rng.sample(range(MAX_NUM + 1), 2)
    return Comparison(first, second, rng.choice(list(OBJECTS)), (a, b),
                      rng.choice(("big", "small")))


@dataclass(frozen=True)
class ProblemSplits:
    train: list[Item]
    val: list[Item]
    test: list[Item]


def _splits(draw: Callable[[random.Random], Item], rng: random.Random, n_train: int,
            n_val: int, n_test: int) -> ProblemSplits:
    """Disjoint train/val/test items (by content, so no test item is seen in training)."""
    seen: set[tuple[object, ...]] = set()
    out: list[Item] = []
    while len(out) < n_train + n_val + n_test:
        p = draw(rng)
        if p.key() not in seen:
            seen.add(p.key())
            out.append(p)
    return ProblemSplits(out[:n_train], out[n_train:n_train + n_val], out[n_train + n_val:])


def problem_splits(seed: int, n_train: int, n_val: int, n_test: int) -> ProblemSplits:
    """Ability A's word problems, split disjointly."""
    return _splits(random_problem, random.Random(seed * 7919 + 11), n_train, n_val, n_test)


def comparison_splits(seed: int, n_train: int, n_val: int, n_test: int) -> ProblemSplits:
    """Ability B's comparison items, split disjointly (115,200 distinct items exist)."""
    return _splits(random_comparison, random.Random(seed * 6151 + 23), n_train, n_val,
                   n_test)


def chance_levels(problems: Sequence[Item]) -> tuple[float, float]:
    """(uniform guess over the answer range, always-the-most-frequent-answer) accuracy."""
    counts: dict[int, int] = {}
    for p in problems:
        counts[p.answer] = counts.get(p.answer, 0) + 1
    return 1.0 / (MAX_NUM + 1), max(counts.values()) / len(problems)


Sampler = Callable[[random.Random], list[str]]


def mixture(parts: Sequence[tuple[float, Sampler]]) -> Sampler:
    """A sampler that draws from weighted component samplers."""
    total = sum(w for w, _ in parts)
    cum: list[tuple[float, Sampler]] = []
    acc = 0.0
    for w, f in parts:
        acc += w / total
        cum.append((acc, f))

    def sample(rng: random.Random) -> list[str]:
        r = rng.random()
        for edge, f in cum:
            if r <= edge:
                return f(rng)
        return cum[-1][1](rng)

    return sample
