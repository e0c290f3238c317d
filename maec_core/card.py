"""The model card README.md, with Hugging Face YAML front matter."""

from __future__ import annotations

import yaml

from maec_core.recipe import Recipe


def model_card(recipe: Recipe, base_models: list[str], summary: str = "") -> str:
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
