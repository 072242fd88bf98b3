"""The reading stages, each a function over lists of samples: read ranges, shuffle, decode, batch."""
