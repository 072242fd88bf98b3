"""The on-disk format: tar members (headers out, a checked parser in) and the manifest.

Each kind of manifest other than a tar dataset's is a ``Manifest`` subclass that registers itself
as it is defined (``Manifest.kinds``), so ``manifest.py`` names none of them (``parquet.py``
imports ``manifest.py``, never the reverse); importing the package defines them all, so
``load_manifest`` knows every kind however it was imported."""

from shardstream.format import parquet as parquet  # registers TableManifest (kind "parquet")
