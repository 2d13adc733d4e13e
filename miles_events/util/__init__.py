"""Small utilities with no domain of their own: the modes of the files a run writes, and
importing what a config names by dotted path."""
