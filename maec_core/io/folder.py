"""Discover a Hugging Face checkpoint folder safely, reading only headers and JSON.

Enforces the security posture: safetensors only (pickle files are refused, never
opened), shard names from the index may not leave the folder, symlinks may not point
outside it, and JSON files are size-capped before parsing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maec_core.errors import (
    CheckpointError,
    CorruptCheckpoint,
    PickleRefused,
    SourceError,
    SourceNotFound,
)
from maec_core.io.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_pairs,
    adapter_spec,
    adapter_tensors,
    base_path,
)
from maec_core.io.headers import SafetensorsHeader, TensorInfo, read_header

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tokenizer and generation files copied into merged outputs. An allow-list, so nothing
# executable (tokenizer code, pickles) is ever carried over.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# A real config.json is a few KB; an index a few hundred KB. The cap defuses JSON bombs.
MAX_JSON_BYTES = 16 * 1024 * 1024
# Side files are sniffed, not parsed (a tokenizer.json is tens of MB and the API checks
# sources per request). The largest real one we know, Gemma 3's tokenizer.json, is 33 MB.
MAX_SIDE_FILE_BYTES = 64 * 1024 * 1024
# Leading bytes of formats that execute code when loaded: pickle (protocol 2+) and the
# zip container torch.save writes. No tokenizer or text file starts with either.
_EXECUTABLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")


def load_json(path: Path, *, what: str, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """Parse a small JSON object file, refusing huge or malformed ones with a typed error."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CorruptCheckpoint(
                f"{what} is {size} bytes, above the {max_bytes} byte cap", file=path.name
            )
        doc = json.loads(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read {what}: {exc.strerror}", file=path.name) from None
    except (ValueError, RecursionError):
        # ValueError covers JSONDecodeError, bad UTF-8, and integer literals longer than
        # int_max_str_digits (a plain ValueError a JSON bomb can trigger on purpose).
        raise CorruptCheckpoint(f"{what} is not valid JSON", file=path.name) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"{what} is not a JSON object", file=path.name)
    return doc


def _inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _escapes(root: Path, what: str, **details: object) -> SourceError:
    # invalid_source, as the API contract names any path that escapes its root.
    return SourceError(f"{root.name}: {what} is a link out of the checkpoint folder", **details)


def _check_config(config: dict[str, Any]) -> None:
    """Type-check the config fields the engine computes with, so a hostile value fails
    here with a typed error rather than as a TypeError deep inside a merge."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise CorruptCheckpoint("config.json: text_config is not an object", field="text_config")
    for where, cfg in (("", config), ("text_config.", text or {})):
        layers = cfg.get("num_hidden_layers")
        if layers is not None and (
            not isinstance(layers, int) or isinstance(layers, bool) or not 0 <= layers < 100_000
        ):
            raise CorruptCheckpoint(
                f"config.json: {where}num_hidden_layers is {layers!r}, not a layer count",
                field=f"{where}num_hidden_layers",
            )
        tie = cfg.get("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool):
            raise CorruptCheckpoint(
                f"config.json: {where}tie_word_embeddings is not true or false",
                field=f"{where}tie_word_embeddings",
            )


def _check_side_files(root: Path) -> None:
    """Side files are copied into outputs and parsed by whoever loads them: each must stay
    inside the folder (a link to /etc/passwd would be published) and not be an executable
    format (a pickle named tokenizer.model) or a non-JSON file with a .json name."""
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        path = root / name
        if not (path.is_file() or path.is_symlink()):
            continue
        if not _inside(root, path):
            raise _escapes(root, name, file=name)
        if not path.is_file():
            raise CorruptCheckpoint(f"{name} is not a regular file", file=name)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(64)
        except OSError as exc:
            raise CheckpointError(f"cannot read {name}: {exc.strerror}", file=name) from None
        if size > MAX_SIDE_FILE_BYTES:
            raise CorruptCheckpoint(
                f"{name} is {size} bytes, above the {MAX_SIDE_FILE_BYTES} byte cap", file=name
            )
        if head.startswith(_EXECUTABLE_MAGIC):
            raise CorruptCheckpoint(
                f"{name} is a pickle or zip archive, not what its name claims", file=name
            )
        if name.endswith(".json") and not head.lstrip().startswith(b"{"):
            raise CorruptCheckpoint(f"{name} is not a JSON object", file=name)
        if name.endswith((".txt", ".jinja")) and b"\x00" in head:
            raise CorruptCheckpoint(f"{name} is binary, not text", file=name)


@dataclass
class ModelFolder:
    """A validated checkpoint folder: config, tensor locations, side files."""

    root: Path
    config: dict[str, Any]
    headers: list[SafetensorsHeader]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    # A LoRA adapter folder: the base it applies to (config and side files are the
    # base's) and its adapter_config.json, which the result depends on as much as on
    # weights (so it is hashed with them).
    base: ModelFolder | None = None
    extra_files: list[Path] = field(default_factory=list)
    # Tokenizer files read while a remote header view existed (the view is gone after
    # planning starts); None: read them from ``root``.
    tokenizer_data: dict[str, bytes] | None = None

    @property
    def weight_files(self) -> list[Path]:
        return [h.file for h in self.headers] + self.extra_files

    @property
    def tie_word_embeddings(self) -> bool:
        tie = self.config.get("tie_word_embeddings")
        if tie is None:
            # Multimodal configs nest the text config; Llama's default is untied.
            tie = (self.config.get("text_config") or {}).get("tie_word_embeddings", False)
        return bool(tie)

    def side_files(self) -> list[Path]:
        if self.base is not None:
            return self.base.side_files()
        names = (*TOKENIZER_FILES, "generation_config.json")
        return [self.root / n for n in names if (self.root / n).is_file()]


def is_adapter_folder(root: Path) -> bool:
    """A PEFT adapter folder: an adapter config and no full weights beside it."""
    return (root / ADAPTER_CONFIG).is_file() and not (
        (root / SINGLE_FILE).is_file() or (root / INDEX_FILE).is_file())


def _open_adapter(root: Path, base: str | Path | ModelFolder | None, config_base: bool
                  ) -> ModelFolder:
    """A LoRA adapter as a checkpoint: ``base`` (else, with ``config_base``, the base its
    config names) with the adapter's low-rank deltas on the tensors it targets. Headers
    only."""
    config_path = root / ADAPTER_CONFIG
    if not _inside(root, config_path):
        raise _escapes(root, ADAPTER_CONFIG, file=ADAPTER_CONFIG)
    spec = adapter_spec(load_json(config_path, what=ADAPTER_CONFIG))
    if isinstance(base, str | Path) and Path(base).resolve() == root.resolve():
        base = None  # the recipe's base is this adapter: its base is the one it names
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise PickleRefused(
                f"{root.name} holds only pickle adapter weights ({', '.join(pickles)}); "
                "pickles can run code when loaded and are refused: save with safetensors",
                files=pickles,
            )
        raise CheckpointError(f"{root.name}: no {ADAPTER_WEIGHTS}", path=str(root))
    if not _inside(root, weights):
        raise _escapes(root, ADAPTER_WEIGHTS, file=ADAPTER_WEIGHTS)
    header = read_header(weights)
    pairs = adapter_pairs(header)  # the adapter is refused for what it is, whatever base
    # An already opened base: a service's header view, whose files may be gone.
    base_folder = base if isinstance(base, ModelFolder) else open_model_folder(
        base if base is not None else base_path(spec, root, allowed=config_base))
    if base_folder.base is not None:
        raise CheckpointError(f"{root.name}: the adapter's base is itself an adapter",
                              path=str(root))
    return ModelFolder(
        root=root, config=base_folder.config, headers=[*base_folder.headers, header],
        tensors=adapter_tensors(spec, pairs, base_folder.tensors), base=base_folder,
        extra_files=[config_path],
    )


def _base_plus_adapter(root: Path) -> ModelFolder | None:
    """mergekit's ``base+adapter`` reference (when no folder has that very name): the
    adapter applied to the base it names; None for any other reference."""
    if root.is_dir() or "+" not in str(root):
        return None
    model, adapter = str(root).rsplit("+", 1)
    if Path(model).is_dir() and is_adapter_folder(Path(adapter)):
        return _open_adapter(Path(adapter), model, False)
    return None


# Reached only where no GGUF step ran first (the command line and the service dequantize
# GGUF sources before the merge opens them), so the message says where GGUF is taken.
_GGUF_HERE = ("{what}: GGUF checkpoints are merged by `maec merge` and by jobs, which "
              "dequantize them first (docs/gguf.md); this reader takes safetensors folders")


def open_model_folder(path: str | Path, *, base: str | Path | ModelFolder | None = None,
                      config_base: bool = False) -> ModelFolder:
    """Validate ``path`` as a safetensors checkpoint folder; read headers, no data.

    A PEFT LoRA adapter folder opens as the checkpoint it makes of its base: the one
    before a ``+`` (``base+adapter``), else ``base`` when given (the recipe's base
    model: its path, or the folder already opened), else, only with ``config_base``, the
    local folder its config names. Off by default: a path inside an untrusted adapter
    must not lead a service past its allow-listed roots.
    """
    root = Path(path)
    plus = _base_plus_adapter(root)
    return plus if plus is not None else _open_folder(root, base, config_base)


def _open_folder(root: Path, base: str | Path | ModelFolder | None, config_base: bool
                 ) -> ModelFolder:
    """:func:`open_model_folder` of a folder reference."""
    if not root.is_dir():
        if root.is_file() and root.suffix.lower() == ".gguf":
            raise CheckpointError(_GGUF_HERE.format(what=f"{root.name} is a GGUF file"),
                                  path=str(root))
        raise SourceNotFound(f"checkpoint folder not found: {root}", path=str(root))
    if is_adapter_folder(root):
        return _open_adapter(root, base, config_base)
    config_path = root / "config.json"
    if not config_path.is_file():
        if any(p.suffix.lower() == ".gguf" for p in root.iterdir()):
            raise CheckpointError(_GGUF_HERE.format(
                what=f"{root.name} holds a GGUF file and no config.json"), path=str(root))
        raise CheckpointError(f"{root.name}: no config.json", path=str(root))
    if not _inside(root, config_path):
        raise _escapes(root, "config.json", file="config.json")
    config = load_json(config_path, what="config.json")
    _check_config(config)
    _check_side_files(root)

    index_path = root / INDEX_FILE
    single = root / SINGLE_FILE
    if index_path.is_file():
        if not _inside(root, index_path):
            raise _escapes(root, INDEX_FILE, file=INDEX_FILE)
        index = load_json(index_path, what=INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpoint(f"{INDEX_FILE} has no weight_map", file=INDEX_FILE)
        shard_names = sorted({str(v) for v in weight_map.values()})
        for name in shard_names:
            if "/" in name or "\\" in name or name in ("", ".", "..") or name.startswith("."):
                raise SourceError(
                    f"{INDEX_FILE} names shard {name!r}, which is not a plain file name",
                    shard=name,
                )
            if name.endswith(PICKLE_SUFFIXES):
                raise PickleRefused(f"index names a pickle shard {name!r}", shard=name)
        files = [root / n for n in shard_names]
    elif single.is_file():
        files = [single]
        weight_map = None
    else:
        pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise PickleRefused(
                f"{root.name} holds only pickle weights ({', '.join(pickles)}); "
                "pickles can run code when loaded and are refused: convert to safetensors",
                files=pickles,
            )
        raise CheckpointError(f"{root.name}: no model.safetensors or index", path=str(root))

    headers: list[SafetensorsHeader] = []
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"shard {f.name} listed in the index is missing", shard=f.name)
        if not _inside(root, f):
            raise _escapes(root, f"shard {f.name}", shard=f.name)
        header = read_header(f)
        headers.append(header)
        for name, info in header.tensors.items():
            if name in tensors:
                raise CorruptCheckpoint(f"tensor {name!r} appears in two shards", tensor=name)
            tensors[name] = info
    if not tensors:
        # An empty checkpoint would plan an empty merge and publish a model with no weights.
        raise CorruptCheckpoint(f"{root.name}: the checkpoint holds no tensors", path=str(root))
    if weight_map is not None:
        for name, shard in weight_map.items():
            found = tensors.get(name)
            if found is None or found.file.name != shard:
                raise CorruptCheckpoint(
                    f"index maps {name!r} to {shard}, which does not hold it", tensor=name
                )
    return ModelFolder(root=root, config=config, headers=headers, tensors=tensors)
