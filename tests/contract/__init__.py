"""The store contract suite: one set of test bodies run against every Store backend."""
