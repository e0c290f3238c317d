"""The model card README.md, with Hugging Face YAML front matter."""

from __future__ import annotations

import yaml

from maec_core.recipe import Recipe


def model_card(recipe: Recipe, base_models: list[str], summary: str = "") -> str:
    from maec_core.parsing import recipe_warnings

    front = {
        "base_model": base_models,
        "library_name": "transformers",
        "tags": ["merge", "maec-service", recipe.merge_method],
    }
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {recipe.name or 'Merged model'}",
        "",
        f"This model was produced by the MAEC merge service with the "
        f"`{recipe.merge_method}` method.",
        "",
    ]
    if summary:
        lines += [summary.rstrip(), ""]
    ignored = recipe_warnings(recipe)
    if ignored:
        # Accepted as mergekit accepts them, and listed so no one reads them as used.
        lines += ["## Ignored recipe fields", "",
                  "The recipe gives these, and the merge does not use them:", "",
                  *(_card_line(w) for w in ignored), ""]
    lines += [
        "## Recipe",
        "",
        "The exact recipe, every default filled in (also in `recipe.yaml`):",
        "",
        "```yaml",
        recipe.to_yaml().rstrip(),
        "```",
        "",
        "`manifest.json` lists every file with its size and sha256.",
        "",
    ]
    return "\n".join(lines)


def _card_line(warning: str) -> str:
    """One warning as a list item: ``- `where`: why`` (a note that names no ignored
    field, such as how a module was read, as it is)."""
    where, sep, why = warning.partition(" ignored: ")
    return f"- `{where}`: {why}" if sep else f"- {warning}"


EVAL_HEADING = "## Evaluation"


def evaluation_section(table_markdown: str, *, leaderboard_markdown: str = "",
                       why: str = "", note: str = "") -> str:
    """The card's evaluation section: the eval table (rows models, columns eval sets)
    and, for a sweep, its leaderboard and why the published candidate won."""
    lines = [EVAL_HEADING, ""]
    if note:
        lines += [note.rstrip(), ""]
    lines += [table_markdown.rstrip(), "",
              "Every item (prompts, outputs, per-document scores) is in `eval_report.json`.",
              ""]
    if leaderboard_markdown:
        lines += ["### Parameter sweep", ""]
        if why:
            lines += [f"Published candidate: {why}.", ""]
        lines += [leaderboard_markdown.rstrip(), "",
                  "The full leaderboard is in `leaderboard.json`, the plot in `sweep.png`.", ""]
    return "\n".join(lines)


def with_evaluation(card: str, section: str) -> str:
    """``card`` with its evaluation section replaced by ``section`` (or added before the
    recipe, where a reader looks first)."""
    start = card.find("\n" + EVAL_HEADING + "\n")
    if start >= 0:
        end = card.find("\n## ", start + len(EVAL_HEADING) + 2)
        tail = card[end + 1:] if end >= 0 else ""
        return card[: start + 1] + section.rstrip() + "\n\n" + tail
    recipe_at = card.find("\n## Recipe\n")
    if recipe_at < 0:
        return card.rstrip() + "\n\n" + section.rstrip() + "\n"
    return card[: recipe_at + 1] + section.rstrip() + "\n\n" + card[recipe_at + 1:]
