"""The writing side: sources listed and loaded, samples encoded, shards and manifest written."""
