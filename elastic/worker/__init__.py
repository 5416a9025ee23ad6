"""Worker-side runtime: the part of `elastic` that runs inside training processes."""
