"""The data plane behind a ``DataRef``: one seam (``base.Transport``), one file per transport."""
