"""The data plane behind a ``DataRef``: the seams in ``base`` (a stager end and a reader end,
by kind of data), one file per transport."""
