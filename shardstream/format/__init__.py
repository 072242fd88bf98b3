"""The on-disk format: tar members (headers out, a checked parser in) and the manifest."""
