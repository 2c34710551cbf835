"""The manifest of a published weight set: where each tensor lies in the set. Pure Python (no
torch, no GPU), so every rule is tested on the CPU.

An engine describes its region's tensors by name: byte offset from the region's base, shape,
stride (in elements), dtype name. The trainer rebuilds the same tensors over its imported copy
of the set, and checks the manifest against what it expects before writing anything.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

#: The manifest format this build writes and reads.
MANIFEST_VERSION = 1

_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (strings pass through)."""
    return str(dtype).replace("torch.", "")


def fnv1a64(data: bytes) -> int:
    """FNV-1a, 64 bit: the hash the Rust crate fingerprints layouts with."""
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True)
class Entry:
    """One tensor of a weight set."""

    name: str
    #: Bytes from the start of the set (the region's base).
    offset: int
    shape: Tuple[int, ...]
    #: In elements, as torch reports them.
    stride: Tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        try:
            return _ITEMSIZE[self.dtype]
        except KeyError:
            raise ValueError(f"tensor `{self.name}`: unsupported dtype {self.dtype}") from None

    @property
    def span(self) -> int:
        """Bytes from the first to one past the last element (0 for an empty tensor)."""
        if any(d == 0 for d in self.shape):
            return 0
        last = sum((d - 1) * s for d, s in zip(self.shape, self.stride))
        return (last + 1) * self.itemsize


@dataclass(frozen=True)
class Manifest:
    """Every tensor of one region's weight set, and the set's size."""

    tag: str
    #: Bytes of each set.
    nbytes: int
    #: How many sets the engine offers.
    sets: int
    entries: Tuple[Entry, ...]
    #: The last version the engine has taken (a reconnecting trainer continues after it); not
    #: part of the fingerprint.
    published: int = 0

    @classmethod
    def build(cls, tag: str, nbytes: int, sets: int, entries: Iterable[Entry]) -> "Manifest":
        """A manifest, checked: unique names, every tensor inside ``nbytes``, offsets aligned
        to the element size."""
        ordered = tuple(sorted(entries, key=lambda e: e.name))
        seen = set()
        for e in ordered:
            if e.name in seen:
                raise ValueError(f"tensor `{e.name}` appears twice")
            seen.add(e.name)
            if len(e.shape) != len(e.stride):
                raise ValueError(f"tensor `{e.name}`: shape {e.shape} and stride {e.stride}")
            if e.offset < 0 or e.offset + e.span > nbytes:
                raise ValueError(
                    f"tensor `{e.name}`: bytes [{e.offset}, {e.offset + e.span}) lie outside "
                    f"the {nbytes} byte weight set (was it allocated outside the region?)"
                )
            if e.offset % e.itemsize:
                raise ValueError(f"tensor `{e.name}`: offset {e.offset} is not aligned")
        return cls(tag=tag, nbytes=nbytes, sets=sets, entries=ordered)

    @property
    def fingerprint(self) -> int:
        """FNV-1a of the tag and every entry: equal manifests, equal fingerprints."""
        body = json.dumps([self.tag, [_entry_row(e) for e in self.entries]], separators=(",", ":"))
        return fnv1a64(body.encode())

    def by_name(self) -> Dict[str, Entry]:
        return {e.name: e for e in self.entries}

    def with_published(self, version: int) -> "Manifest":
        return dataclasses.replace(self, published=version)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": MANIFEST_VERSION,
                "tag": self.tag,
                "nbytes": self.nbytes,
                "sets": self.sets,
                "published": self.published,
                "fingerprint": self.fingerprint,
                "entries": [_entry_row(e) for e in self.entries],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Parses a manifest; ``ValueError`` for anything malformed, another version, or a
        fingerprint that does not match the entries."""
        try:
            raw = json.loads(text)
            if raw.get("version") != MANIFEST_VERSION:
                raise ValueError(
                    f"manifest version {raw.get('version')}, this build reads {MANIFEST_VERSION}"
                )
            entries = [
                Entry(str(n), int(o), tuple(int(d) for d in s), tuple(int(d) for d in st), str(t))
                for n, o, s, st, t in raw["entries"]
            ]
            manifest = cls.build(str(raw["tag"]), int(raw["nbytes"]), int(raw["sets"]), entries)
            manifest = manifest.with_published(int(raw.get("published", 0)))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as bad:
            raise ValueError(f"malformed manifest: {bad}") from None
        if manifest.fingerprint != raw.get("fingerprint"):
            raise ValueError("malformed manifest: its fingerprint does not match its entries")
        return manifest

    def first_mismatch(self, expected: Mapping[str, Any], *, dtypes: bool = True) -> Optional[str]:
        """The first difference between the manifest and ``expected`` (name → anything with
        ``shape`` and ``dtype``, or a ``(shape, dtype)`` pair), in words; ``None`` if they
        agree. Names are checked first (missing, then unexpected), then per name (sorted)
        the shape, then the dtype (unless ``dtypes=False``: the trainer casts)."""
        mine = self.by_name()
        if expected.keys() == mine.keys() and all(
            _agrees(mine[name], value, dtypes) for name, value in expected.items()
        ):
            return None  # the usual case, once per publish: no sorting, one pass
        for name in sorted(expected):
            if name not in mine:
                return f"tensor `{name}` is not in the engine's weight set"
        for name in sorted(mine):
            if name not in expected:
                return f"the engine's tensor `{name}` is not among the expected tensors"
        for name in sorted(expected):
            shape, dtype = _shape_and_dtype(expected[name])
            entry = mine[name]
            if tuple(shape) != entry.shape:
                return f"tensor `{name}`: shape {tuple(entry.shape)} in the engine, {tuple(shape)} expected"
            if dtypes and dtype is not None and dtype_name(dtype) != entry.dtype:
                return f"tensor `{name}`: dtype {entry.dtype} in the engine, {dtype_name(dtype)} expected"
        return None


def _entry_row(e: Entry) -> list:
    return [e.name, e.offset, list(e.shape), list(e.stride), e.dtype]


def _agrees(entry: Entry, value: Any, dtypes: bool) -> bool:
    shape, dtype = _shape_and_dtype(value)
    if tuple(shape) != entry.shape:
        return False
    return not dtypes or dtype is None or dtype_name(dtype) == entry.dtype


def _shape_and_dtype(value: Any) -> Tuple[Sequence[int], Any]:
    if hasattr(value, "shape"):
        return tuple(value.shape), getattr(value, "dtype", None)
    shape, dtype = value
    return tuple(shape), dtype


class VersionBook:
    """Versions must grow: the last one committed, and the check of the next."""

    def __init__(self, last: int = 0) -> None:
        self.last = last

    def problem(self, version: int) -> Optional[str]:
        """Why ``version`` cannot be committed next, or ``None``."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            return f"version {version!r}: versions are integers from 1"
        if version <= self.last:
            return f"version {version} is not newer than version {self.last}, published already"
        return None

    def advance(self, version: int) -> None:
        self.last = version
