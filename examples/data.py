"""A small real-English corpus, a character tokenizer and data-parallel batches.

The corpus is the docstrings of a fixed list of standard-library modules, so it
exists on every machine with Python and needs no network. It is built once and
cached in `examples/data/corpus.txt` (delete the file to rebuild it). Its exact
text depends on the Python version that built it.
"""
from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import torch

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
MAX_CORPUS_BYTES = 300_000

# Sorted, so the corpus text comes out in the same order everywhere.
MODULES = sorted([
    "abc", "argparse", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "enum", "fnmatch",
    "fractions", "functools", "glob", "heapq", "inspect", "itertools", "json", "logging",
    "operator", "pathlib", "pprint", "random", "re", "shlex", "shutil", "statistics",
    "string", "struct", "tarfile", "tempfile", "textwrap", "typing", "unittest",
    "zipfile",
])


def _defined_in(obj: object, module_name: str) -> bool:
    """Whether `obj` belongs to the module, counting its package and its C accelerator
    (`heapq.heappush` reports `_heapq`); re-exports from other modules do not count."""
    owner = (getattr(obj, "__module__", None) or "").split(".")[0]
    return owner in (module_name, f"_{module_name}")


def _module_docs(module_name: str):
    """(title, docstring) of the module, then of its public classes and functions by name."""
    module = importlib.import_module(module_name)
    yield module_name, module.__doc__
    public = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    for name in sorted(public):
        obj = getattr(module, name, None)
        if (inspect.isclass(obj) or inspect.isroutine(obj)) and _defined_in(obj, module_name):
            # `__doc__`, not `inspect.getdoc`: the latter falls back to a base class's
            # docstring, which would repeat `object`'s text for every undocumented class.
            yield f"{module_name}.{name}", obj.__doc__


def build_corpus() -> str:
    """The docstring corpus, at most `MAX_CORPUS_BYTES` of UTF-8, each text once."""
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for module_name in MODULES:
        for title, doc in _module_docs(module_name):
            if not isinstance(doc, str) or not doc.strip():
                continue
            text = inspect.cleandoc(doc)
            if text in seen:  # aliases and shared boilerplate would overweight one text
                continue
            seen.add(text)
            part = f"{title}\n\n{text}\n\n"
            size += len(part.encode("utf-8"))
            if size > MAX_CORPUS_BYTES:
                return "".join(parts)
            parts.append(part)
    return "".join(parts)


def load_corpus(path: Path = CORPUS_PATH) -> str:
    """The cached corpus, built and written first if the file is missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename: ranks launched together may all build it, and none
        # must ever read a half-written file.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(build_corpus(), encoding="utf-8")
        os.replace(tmp, path)
    return path.read_text(encoding="utf-8")


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of the text's characters."""

    def __init__(self, text: str):
        self.vocab = sorted(set(text))
        self._index = {ch: i for i, ch in enumerate(self.vocab)}

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._index[ch] for ch in text], dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.vocab[i] for i in tokens.tolist())


def batches(tokens: torch.Tensor, batch_size: int, block_size: int, step: int,
            dp_rank: int, dp_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's shard (x, y) of the global batch of `step`.

    The global batch is `batch_size` windows of `block_size + 1` tokens at offsets
    drawn from a generator seeded with `seed + step`, so every rank (and a
    single-process run) sees the same global batch; rank `dp_rank` takes rows
    [dp_rank * batch_size / dp_size, (dp_rank + 1) * batch_size / dp_size).
    `y` is `x` shifted by one token. Both are LongTensors of shape
    (batch_size / dp_size, block_size).
    """
    if dp_size < 1 or batch_size % dp_size != 0:
        raise ValueError(f"batch_size {batch_size} must be a multiple of dp_size {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} must be in [0, {dp_size})")
    if tokens.numel() <= block_size + 1:
        raise ValueError(f"{tokens.numel()} tokens are too few for windows of block_size {block_size} + 1")
    generator = torch.Generator().manual_seed(seed + step)
    # Every rank draws the whole global batch's offsets so the generator stays in step.
    starts = torch.randint(0, tokens.numel() - block_size, (batch_size,), generator=generator)
    rows = batch_size // dp_size
    mine = starts[dp_rank * rows:(dp_rank + 1) * rows]
    windows = torch.stack([tokens[s:s + block_size + 1] for s in mine.tolist()])
    # Separate contiguous tensors, as a data loader gives: views of one storage
    # would be aliased inputs to the compiled step.
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
