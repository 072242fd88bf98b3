"""Mixes as users write them: ``Source`` values and mix files (JSON, or YAML when pyyaml is
installed), resolved to one manifest per source. The planning itself is ``plan/mix.py``.

A mix file::

    sources:
      - url: s3://bucket/web/train       # a dataset root, index.json URL or shard pattern
        weight: 0.7                      # or repeat: 2.0, or samples: 100000
        name: web                        # what batches say in __source__ (default: the url)
        storage_options: {endpoint_url: "http://127.0.0.1:9000"}
      - url: ../curated                  # relative to the mix file's directory
        weight: 0.3

A plain list of such entries is accepted too. A ``.yaml``/``.yml`` URL, or a ``.json`` URL other
than ``index.json`` whose document has ``sources``, is read as a mix file wherever a dataset URL
is accepted.
"""

from __future__ import annotations

import importlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardstream.errors import ConfigError, ManifestError
from shardstream.format.manifest import MANIFEST_NAME, Manifest
from shardstream.plan.mix import Ask, MixPlan, plan_mix
from shardstream.storage import fs as storage

MIX_KEYS = ("url", "weight", "repeat", "samples", "name", "storage_options")


@dataclass(frozen=True, eq=False)
class Source:
    """One dataset of a mix and what it asks of every epoch: ``weight`` (share among the weighted
    sources), ``repeat`` (passes per epoch, fractional allowed) or ``samples`` (per epoch); with
    none of them, ``repeat=1``. ``storage_options`` default to the stream's."""

    url: str | Sequence[str] | Manifest
    weight: float | None = None
    repeat: float | None = None
    samples: int | None = None
    storage_options: Mapping[str, Any] | None = None
    name: str | None = None

    def ask(self) -> Ask:
        if self.weight is None and self.repeat is None and self.samples is None:
            return Ask(repeat=1.0)
        return Ask(weight=self.weight, repeat=self.repeat, samples=self.samples)

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        if isinstance(self.url, str):
            return self.url
        if isinstance(self.url, Manifest):
            return self.url.base_url or "manifest"
        return ",".join(self.url)


@dataclass
class Mix:
    """Resolved sources: their manifests and storage options, and the plan of any epoch."""

    sources: list[Source]
    manifests: list[Manifest]
    storage_options: list[dict[str, Any]]
    names: list[str] = field(default_factory=list)

    def plan(self, *, world_size: int, num_workers: int, batch_size: int, seed: int, epoch: int, shuffle: bool,
             per_batch: str) -> MixPlan:
        return plan_mix([m.counts.tolist() for m in self.manifests], [s.ask() for s in self.sources],
                        world_size=world_size, num_workers=num_workers, batch_size=batch_size, names=self.names,
                        seed=seed, epoch=epoch, shuffle=shuffle, per_batch=per_batch)


def is_mix_url(url: str) -> bool:
    """A mix file by its name: .yaml/.yml, or .json other than a manifest (confirmed by its content)."""
    name = url.rstrip("/").rsplit("/", 1)[-1].lower()
    return name.endswith((".yaml", ".yml")) or (name.endswith(".json") and name != MANIFEST_NAME)


def parse_mix(text: str | bytes, url: str) -> list[Source] | None:
    """The sources of a mix file's text; None for a JSON document that is not a mix (a manifest)."""
    name = url.rstrip("/").rsplit("/", 1)[-1].lower()
    if name.endswith((".yaml", ".yml")):
        try:
            # Imported by name: pyyaml is optional, and whether its type stubs are installed must not matter.
            yaml: Any = importlib.import_module("yaml")
        except ImportError as exc:
            raise ConfigError(f"{url}: reading a YAML mix file needs pyyaml (pip install pyyaml), "
                              "or write the mix as JSON") from exc
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{url}: not valid YAML ({exc})") from exc
    else:
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{url}: not valid JSON ({exc})") from exc
        if isinstance(doc, dict) and "sources" not in doc:
            return None
    entries = doc.get("sources") if isinstance(doc, dict) else doc
    if isinstance(doc, dict) and set(doc) - {"sources"}:
        raise ConfigError(f"{url}: unknown top-level keys {sorted(set(doc) - {'sources'})}; a mix file has 'sources'")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{url}: a mix file lists its sources (a non-empty list under 'sources')")
    base = url.rsplit("/", 1)[0] if "/" in url else "."
    sources = []
    for n, entry in enumerate(entries):
        where = f"{url}: source {n + 1}"
        if isinstance(entry, str):
            entry = {"url": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"{where}: each source is a mapping with a 'url' string, got {entry!r}")
        unknown = set(entry) - set(MIX_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(MIX_KEYS)})")
        options = entry.get("storage_options")
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"{where}: storage_options must be a mapping, got {options!r}")
        source_url = entry["url"]
        if "://" not in source_url and not source_url.startswith("/"):
            source_url = _relative_to(base, source_url)
        try:
            source = Source(source_url, weight=entry.get("weight"), repeat=entry.get("repeat"),
                            samples=entry.get("samples"), storage_options=options, name=entry.get("name"))
            source.ask()
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        sources.append(source)
    return sources


def _relative_to(base: str, path: str) -> str:
    """``path`` relative to the mix file's directory ``base`` ('..' resolved, the protocol kept)."""
    protocol, sep, rest = base.partition("://")
    if not sep:
        return posixpath.normpath(storage.join(base, path))
    return f"{protocol}://{posixpath.normpath(posixpath.join(rest, path))}"


def read_mix_file(url: str, storage_options: Mapping[str, Any] | None = None) -> list[Source] | None:
    from shardstream.errors import StorageError

    fs, path = storage.get_fs(url, storage_options)
    try:
        raw = storage.read_bytes(fs, path)
    except StorageError as exc:
        raise ConfigError(f"{url}: cannot read the mix file ({exc})") from exc
    return parse_mix(raw, url)


def open_mix(source: Any, storage_options: Mapping[str, Any] | None,
             resolve: Any) -> Mix | None:
    """A Mix when ``source`` is a Source, a list of Sources or a mix file URL; None otherwise.

    ``resolve(url, storage_options)`` turns one source's URL into its manifest (the stream's own
    resolver, so shard patterns work in mixes too).
    """
    if isinstance(source, Source):
        sources = [source]
    elif isinstance(source, Sequence) and not isinstance(source, str) and source \
            and all(isinstance(s, Source) for s in source):
        sources = list(source)
    elif isinstance(source, Sequence) and not isinstance(source, str) and any(isinstance(s, Source) for s in source):
        raise ConfigError("a mix is a list of Source values only; wrap every dataset in Source(...)")
    elif isinstance(source, str) and is_mix_url(source):
        found = read_mix_file(source, storage_options)
        if found is None:
            return None
        sources = found
    else:
        return None
    options = [dict(storage_options or {}) if s.storage_options is None else dict(s.storage_options) for s in sources]
    manifests = []
    for s, opts in zip(sources, options):
        try:
            manifests.append(resolve(s.url, opts))
        except (ConfigError, ManifestError) as exc:
            raise type(exc)(f"mix source {s.label!r}: {exc}") from exc
    names = [s.label for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"two mix sources share a name ({names}); give each a distinct name=")
    return Mix(sources, manifests, options, names)
